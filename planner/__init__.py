"""Goodput planner for cluster-scale training: expected ETTR, checkpoint interval and FSx sizing.

    python -m planner --params 70e9 --gpus 16384,100000      # or: make planner ARGS=...

One module per job:

- ``failures``: failure rates (per 1,000 node-days) and the mix of failure kinds, each with the
  recovery it needs (Llama 3: hardware faults replace a node; software and network faults
  restart in place), hot spares and a lemon-node share.
- ``costs``: the cost model. Every term is a function of the job size, every default names its
  source (or says it is an estimate) and every default can be overridden (``--set``).
- ``measured``: the CPU measurements from ``make bench``, selectable (``--costs measured-cpu``)
  and labelled as what they are; never the default.
- ``ettr``: optimal checkpoint interval, the closed-form ETTR for a mix of failure kinds and a
  Monte Carlo simulation that samples the mix.
- ``fsx``: FSx for Lustre PERSISTENT_2 sizing in valid increments (from ``facts.fsx``).
- ``plan``: ties them together for every size x failure rate x restart mode.
- ``report`` / ``plot`` / ``cli``: text tables, docs/planner.png and the command line.
"""
