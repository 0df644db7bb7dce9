"""Checkpoints: the on-disk format (format: tags, the COMPLETE marker, fp32 state dicts), the
Checkpointer that saves, resumes, rolls back and exports (manager), resuming on another world
size (elastic), and manifests and free space (storage)."""
