"""The GPU run planned on the CPU: ``mpp plan CONFIG --gpus N`` (``python -m mpp.tools.planner``;
memory, FLOPs, communication, the recipe); see docs/gpu.md, "Planning the GPU run". The batch plan a run
resolves before it starts is ``mpp.train.plan``."""
