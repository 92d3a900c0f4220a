"""Adapters that ship with the harness: xtrain's own trainers (xtrain.py) and the deliberately broken
trainers the gates must reject (broken*.py, ddp_modes.py), each one hook of the micro-step template
(template.py), all listed with the gate that must reject them in one registry (planted.py). Your own
adapter lives in your code: see docs/verify-your-trainer.md."""
