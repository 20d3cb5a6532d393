"""Launching ``omniscale train`` on clusters: ``torchrun.sh`` (one node or several),
``slurm.sbatch`` with ``slurm_node.sh`` (one task per node, the data plane on the first), and
:mod:`tools.launch.plane_args`, the ``omniscale plane serve`` flags that fit a run."""
