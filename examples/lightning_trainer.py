"""Lightning's Trainer, its own loop (fit()), Trainer(accumulate_grad_batches=N): an MLP regressor with MSE
and AdamW in a LightningModule, run as users run it. verify.Pull runs fit() in a thread and feeds it the
harness's micro-batches through its dataset (docs/verify-your-trainer.md, "The framework owns the loop").

    pip install "xtrain[examples]"      # lightning
    pytest --pyargs verify --verify-trainer examples.lightning_trainer:factory -n auto
    python -m verify.selftest --verify-trainer examples.lightning_trainer:factory
"""
import logging

import lightning as L
import torch
import torch.nn.functional as F

import verify

# no start-up notes: the gates build hundreds of trainers
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


class Regressor(L.LightningModule):
    def __init__(self, spec):
        super().__init__()
        torch.manual_seed(spec.seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(spec.dtype)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


# data_parallel: under the harness's process group (W ranks, launched like torchrun) Lightning runs DDP, and
# its training loop broadcasts a SIGTERM flag (one int64) on every batch: traffic before the boundary, declared.
SIGTERM = verify.Expected("broadcast", count=1, dtype="integer", why="Lightning's per-batch SIGTERM flag broadcast")


@verify.adapter(data=verify.data.regression(features=8), data_parallel=True, expected=(SIGTERM, *verify.DDP_EXPECTED))
def factory(spec):
    module = Regressor(spec)
    pull = verify.Pull(spec)
    if torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    else:
        world = 1
    accelerator = "cpu" if spec.device == "cpu" else "gpu"
    strategy = "ddp" if world > 1 else "auto"
    trainer = L.Trainer(accumulate_grad_batches=spec.accum_steps, max_epochs=1, devices=world,
                        accelerator=accelerator, strategy=strategy, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # the dataset's items are whole micro-batches, hence batch size 1
    loader = torch.utils.data.DataLoader(pull.dataset, batch_size=1, collate_fn=pull.collate)

    def fit():
        trainer.fit(module, loader)

    return pull.start(fit, module)
