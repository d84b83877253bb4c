"""Where each default comes from: one line per source, cited by key in costs and failures."""

from __future__ import annotations

SOURCES: dict[str, str] = {
    "llama3": (
        'Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783 (2024), sec. 3.3.4 and '
        "Table 5: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs "
        "(2,048 nodes), ~78% confirmed or suspected hardware"
    ),
    "rsc": (
        'Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research '
        'Clusters", HPCA 2025, arXiv:2410.21680: RSC-1 6.5 and RSC-2 2.34 failures per 1,000 '
        "node-days; lemon-node detection"
    ),
    "nvrx-latency": (
        "NVRx 0.4.1 docs, in-process restart usage guide, 'Restart latency' table "
        "(docs/source/inprocess/usage_guide.rst; nvidia.github.io/nvidia-resiliency-ext): "
        "destroy_process_group ~0.5 s, rank_assignment ~0.5 s, TCPStore barrier 0.5 s @ 16k "
        "ranks, pending CUDA kernels ~1 iteration, last_call_wait, hang detection = "
        "soft_timeout + monitor_process_interval"
    ),
    "project-wrapper": (
        "this project's inprocess.Wrapper settings (training/resilience/nvrx.py): "
        "last_call_wait 0.1 s, monitor_process_interval 0.5 s, heartbeat_timeout "
        "max(10 s, soft_timeout_s); NVRx 0.4.1 inprocess/monitor_thread.py (peers abort "
        "last_call_wait after the first interruption record) and monitor_process.py (timeouts "
        "checked every monitor_process_interval)"
    ),
    "project": (
        "this project's training/config.py defaults: resilience soft_timeout_s 20, "
        "heartbeat_timeout_s 30, stop_timeout_s 10; parallel pg_timeout_s 600 (torch's NCCL "
        "default, 10 min)"
    ),
    "tcpstore": (
        'PyTorch tutorial "Introduction to Libuv TCPStore Backend" (PyTorch 2.4, '
        "pytorch.org/tutorials/intermediate/TCPStore_libuv_backend.html): TCPStore "
        "initialisation at 98,304 ranks completes in ~100 s"
    ),
    "ncclx": (
        'Si et al. (Meta), "Collective Communication for 100k+ GPUs" (NCCLX), arXiv:2510.20171 '
        "(2025): stock NCCL bootstrap and connection set-up take ~265 s at 96k GPUs and grow "
        "super-linearly"
    ),
    "fsx": (
        "facts/fsx.py, from the Amazon FSx for Lustre User Guide: PERSISTENT_2 SSD capacity "
        "1.2 TiB, 2.4 TiB, then multiples of 2.4 TiB; 125/250/500/1000 MB/s per TiB"
    ),
    "checkpoint": (
        "facts/checkpoint.py: 12 B/param (fp32 params + AdamW moments; this trainer's DCP state)"
    ),
    "eks-repair": (
        'Amazon EKS User Guide, "Automatically repair nodes in EKS clusters" '
        "(docs.aws.amazon.com/eks/latest/userguide/node-repair.html): a node whose "
        "AcceleratedHardwareReady condition fails is replaced or rebooted after 10 min"
    ),
    "fencer": (
        "infra/fencer/settings.py (FENCER.wait_s), the node fencer this stack ships: a GPU node "
        "whose Ready stays Unknown this long is terminated, then tainted out-of-service "
        "(docs/node-loss.md, 'The fencer')"
    ),
    "soci": (
        'AWS Machine Learning Blog, "Reducing container cold start times using SOCI index on '
        'DLAMI and DLC": standard pulls of 15-20 GB images take 4-6 min per instance'
    ),
    "k8s-slo": (
        "Kubernetes SIG Scalability SLO 'pod startup latency' "
        "(kubernetes/community sig-scalability/slos/pod_startup_latency.md): p99 <= 5 s for "
        "stateless pods, image pull excluded"
    ),
    "k8s-grace": "Kubernetes Pod API: terminationGracePeriodSeconds defaults to 30 s",
    "k8s-node-lifecycle": (
        "kube-controller-manager --node-monitor-grace-period: 50 s from Kubernetes 1.32 "
        "(kubernetes/kubernetes#127352; 40 s before), after which a silent node is Ready=Unknown "
        "(docs/node-loss.md, step 1)"
    ),
    "k8s-podgc": (
        "kubernetes pkg/controller/podgc/gc_controller.go: quarantineTime 40 s, gcCheckPeriod "
        "20 s; an orphaned pod is marked Failed and deleted, and only then replaced by the Job "
        "controller with a podFailurePolicy (docs/node-loss.md, steps 5 and 7)"
    ),
    "p5": (
        "facts/hardware.py: AWS 'Amazon EC2 P5 Instances', p5.48xlarge 3,200 Gbps EFA per node "
        "(400 GB/s each way), 2 TiB host memory; two AMD EPYC 7R13 sockets of eight DDR4-3200 "
        "channels (409.6 GB/s nominal)"
    ),
    "node-loss-emulation": (
        "bench/results/node_loss.json (bench/node_loss.py): pods emulated on a CPU machine "
        "(gloo ranks, tiny model), Kubernetes timers scaled by 1/timer_scale; the restart after "
        "the replacement runs is measured, the timers are the documented ones"
    ),
    "pcie": (
        "PCI Express 5.0 x16 (the H100 SXM host link): 64 GB/s per direction nominal (PCI-SIG)"
    ),
    "llama3-planned": (
        "Dubey et al. 2024 (llama3), sec. 3.3.4: 466 interruptions in the 54 days, 47 planned "
        "(firmware upgrades, configuration or dataset updates); significant manual intervention "
        "only three times; '>90% effective training time'"
    ),
    "prices": (
        "facts/prices.py: EC2 Capacity Blocks for ML pricing (aws.amazon.com/ec2/capacityblocks/"
        "pricing/, table valid until 2025-01-01), p5.48xlarge us-east-1 $39.33/h = $4.916 per "
        "GPU-hour; Amazon FSx for Lustre pricing (aws.amazon.com/fsx/lustre/pricing/), us-east-1 "
        "Persistent-2 SSD $0.145/$0.210/$0.340/$0.600 per GB-month at 125/250/500/1000 MB/s/TiB"
    ),
    "erlang": (
        "Erlang's loss formula B(K, a) for a pool of K spares refilled after a time of any "
        "distribution (insensitivity: Sevastyanov 1957; Kleinrock, Queueing Systems vol. 1)"
    ),
    "kokolis-projection": (
        "Kokolis et al. 2025 (rsc), sec. 4 'Quantifying ETTR': a hypothetical 16k-GPU job on "
        "RSC-1 (6.5 failures/1,000 node-days), restart overhead u0 = 5 min, non-blocking "
        "checkpoints: E[ETTR] 0.70 at 60-min and 0.93 at 5-min checkpoint intervals"
    ),
    "byterobust": (
        'Wan et al., "Robust LLM Training Infrastructure at ByteDance" (ByteRobust), '
        "arXiv:2509.16293 (2025): 97% ETTR for a three-month job on 9,600 GPUs, with warm "
        "standby machines, in-place hot updates and near-zero-overhead checkpoints"
    ),
    "torchft": (
        "torchft (github.com/pytorch/torchft, torchft-nightly==2026.10.26 in requirements.lock): "
        "per-step quorum across HSDP replica groups (Manager + Lighthouse); a failed group heals "
        "from a live peer while the others continue, no global NCCL re-initialisation; what "
        "--restart replica is built on (docs/replica-groups.md)"
    ),
    "replica-emulation": (
        "this project's replica-group fault test, recorded run "
        "tests/training/replica/recorded/sigkill-group1 (2 groups x 2 CPU ranks, gloo, tiny "
        "model, one loaded 2-core machine), and bench/results/goodput.json's replica section: "
        "EMULATION, not GPU or cluster figures"
    ),
    "meta-ft-hsdp": (
        'Salpekar et al., "Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", '
        "arXiv:2602.00277 (Meta, 2026): a failure takes one data-parallel replica offline while "
        "the others train; stall per failure 10 -> 3 min, effective training time 44% -> 80% "
        "at O(100k) GPUs"
    ),
    "hyperpod-checkpointless": (
        "Amazon SageMaker HyperPod checkpointless training (docs.aws.amazon.com/sagemaker/latest/"
        "dg/sagemaker-eks-checkpointless-in-process-recovery.html): model and optimizer state "
        "replicated across node groups, healthy replicas send their state to the recovering "
        "one, no rollback to a checkpoint; recovery in under 2 minutes as issue 40 quotes it "
        "(AWS's announcement, not a documented bound)"
    ),
    "nvrx-reserve": (
        "NVRx 0.4.1 inprocess/rank_assignment.py: the Tree rank assignment replaces terminated "
        "ranks with inactive ranks of the nearest layer flagged LayerFlag.RESERVE, inside the "
        "running job (modelled here as NOT SHIPPED, the reserve ranks on the hot spares)"
    ),
    "estimate": "no published figure found: an estimate, override with --set NAME=VALUE",
    "bench": (
        "make bench on this project's 2-core CPU machine (bench/results/*.json): gloo, tiny "
        "model, local disk; NOT cluster-scale numbers"
    ),
}
