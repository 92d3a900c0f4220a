"""Lightning's Trainer, its own loop (fit()), Trainer(accumulate_grad_batches=N, gradient_clip_val=...): an MLP
regressor with MSE, AdamW and a per-step warm-up in a LightningModule, run as users run it, the loss, gradient
norm and LR it logs checked. verify.Pull runs fit() in a thread and feeds it the harness's micro-batches
through its dataset (docs/verify-your-trainer.md, "The framework owns the loop").

    pip install "xtrain[examples]"      # lightning
    pytest --pyargs verify --verify-trainer examples.lightning_trainer:factory -n auto
    python -m verify.selftest --verify-trainer examples.lightning_trainer:factory
"""
import logging

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm

import verify

# no start-up notes: the gates build hundreds of trainers
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
MAX_NORM = 1.0


def warmup(step):
    """The LR factor of a 3-step linear warm-up."""
    return min(1.0, (step + 1) / 3)


class Regressor(L.LightningModule):
    def __init__(self, spec):
        super().__init__()
        torch.manual_seed(spec.seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(spec.dtype)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        # logged per micro-batch: at the optimizer step Lightning holds the window's last one (loss="last_micro")
        self.log("loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Lightning calls it once the window is accumulated, before it clips: the pre-clip norm, the LR to apply
        self.log_dict(grad_norm(self, norm_type=2))
        self.log("lr", optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        # interval "step": once per optimizer step (Lightning's default interval is the epoch)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# data_parallel: under the harness's process group (W ranks, launched like torchrun) Lightning runs DDP, and
# its training loop broadcasts a SIGTERM flag (one int64) on every batch: traffic before the boundary, declared.
SIGTERM = verify.Expected("broadcast", count=1, dtype="integer", why="Lightning's per-batch SIGTERM flag broadcast")
# What the module logs, read from trainer.callback_metrics after each optimizer step
METRICS = verify.Metrics(names=("loss", "grad_norm", "lr"), max_norm=MAX_NORM, loss="last_micro")


@verify.adapter(data=verify.data.regression(features=8), metrics=METRICS,
                distributed=verify.Distributed(data_parallel=True, expected=(SIGTERM, *verify.DDP_EXPECTED)))
def factory(spec):
    module = Regressor(spec)
    pull = verify.Pull(spec)
    if torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    else:
        world = 1
    accelerator = "cpu" if spec.device == "cpu" else "gpu"
    strategy = "ddp" if world > 1 else "auto"
    trainer = L.Trainer(accumulate_grad_batches=spec.accum_steps, gradient_clip_val=MAX_NORM, max_epochs=1,
                        devices=world, accelerator=accelerator, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # the dataset's items are whole micro-batches, hence batch size 1
    loader = torch.utils.data.DataLoader(pull.dataset, batch_size=1, collate_fn=pull.collate)

    def fit():
        trainer.fit(module, loader)

    def logged():
        """What the module logged for the step that just ran."""
        logs = trainer.callback_metrics
        return {"loss": logs["loss"], "grad_norm": logs["grad_2.0_norm_total"], "lr": logs["lr"]}

    return pull.start(fit, module, metrics=logged)
