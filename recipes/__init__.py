"""Distillation and fine-tuning recipes (installed as ``linearize.recipes``)."""
