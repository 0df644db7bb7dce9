"""On top of everything, imported by nothing of the library: the masking ablation (ablation,
ablation_jobs, ablation_report), the demo, the pictures (viz, masking_viz), the GPU planner
(planner/: ``mpp plan``), the first-node checks (doctor/: ``mpp doctor``, with its
engine step), and the FLOP formula (flops) and timing (measure) they share with the clone's
benchmarks/ (``python -m benchmarks``)."""
