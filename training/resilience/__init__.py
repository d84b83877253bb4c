"""Restart layers and fault injection.

- ``layer``: picks the restart layer of a run (``--restart none|inprocess|injob|nested``):
  ``nested`` runs the in-process layer inside ``ft_launcher`` (NVRx 0.4.1's own combination, its
  ``run_inprocess_injob_example.sh``).
- ``inprocess``, ``injob``, ``hang``, ``sections``, ``gloo_abort``, ``nvrx``: the layers and the
  NVRx calls they make.
- ``faults`` (the torch-free fault spec) and ``inject`` (the injector, a step hook).
"""
