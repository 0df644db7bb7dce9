"""On top of everything, imported by nothing of the library: the masking ablation (ablation,
ablation_jobs, ablation_report), the demo, and the pictures (viz, masking_viz)."""
