"""Evaluation of a pretrained encoder: fine-tuning (finetune, evaluate), linear probes and k-NN
(probe, probe_protocols, probe_cli)."""
