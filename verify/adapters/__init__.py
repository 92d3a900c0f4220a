"""Adapters that ship with the harness: xtrain's own trainers (xtrain.py) and the deliberately broken
trainers the gates must reject (broken.py, broken_dist.py). Your own adapter lives in your code:
see docs/verify-your-trainer.md."""
