"""The GPU run planned on the CPU: ``python -m mpp.tools.planner CONFIG --gpus N`` (memory, FLOPs,
communication, the recipe); see README "Planning a GPU run". The batch plan a run resolves
before it starts is ``mpp.train.plan``."""
