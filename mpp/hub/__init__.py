"""Weights in and out: any encoder file, timm or Hugging Face folder, MAE release or run in
(pretrained); safetensors, timm and Hugging Face out (export, hf) (docs/ARCHITECTURE.md §4.9)."""
