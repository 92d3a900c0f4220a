import torch

torch.set_num_threads(1)

from verify._gpulock import _gpu_sharing  # noqa: E402,F401  (GPU tests share the GPU lock; verify/_gpulock.py)
