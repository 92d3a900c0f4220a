"""torchtitan's own train step (Trainer.train_step, unmodified) on its llama3 debug model, parallelised by its own
parallelize_fn (FSDP2 over dp): it fetches the window's micro-batches, counts their valid tokens over dp,
backpropagates each micro-batch's token sum / that count, clips and steps. verify.Pull runs the step loop in a
thread; the parts Trainer.__init__ would build are built here from its config, on the CPU too (see build()).

    pip install "xtrain[torchtitan]"        # torchtitan 0.3.0 and triton (imported by its MoE kernels)
    pytest --pyargs verify --verify-trainer examples.torchtitan_train:factory
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
import torchtitan.distributed.parallel_dims
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.tools import utils
from torchtitan.trainer import Trainer

import verify

SEQ = 8
VOCAB = 2048  # the debug model's

# torchtitan takes "cuda" where it finds no accelerator (tools/utils.get_device_info): its meshes are built there
if not torch.cuda.is_available():
    torchtitan.distributed.parallel_dims.device_type = "cpu"
# its dtype table stops at float32; the harness's reference runs are float64 (FSDP2's param_dtype is looked up here)
TORCH_DTYPE_MAP.setdefault("float64", torch.float64)
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}


class NoCheckpoint:
    """Checkpointing is off: train_step only waits for a staged save."""

    def maybe_wait_for_staging(self):
        pass


class Logged:
    """What train_step logs each step (it logs through its MetricsProcessor, which reads GPU memory stats)."""

    def __init__(self):
        self.step = {}
        self.ntokens_since_last_log = 0

    def should_log(self, step):
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.step = {"loss": global_avg_loss, "grad_norm": grad_norm, "lr": extra_metrics["lr/AdamW"]}


def build(spec):
    """torchtitan's Trainer with what its __init__ builds, from the debug model's config: the mesh (ParallelDims),
    the model (meta init, parallelize_fn, init_weights), the loss, optimizer and LR schedule, the accumulation steps.
    __init__ itself selects a "cuda" device and reads GPU memory statistics, which a CPU has not."""
    config = llama3_debugmodel()
    mesh = spec.mesh
    world = dist.get_world_size()
    dp = world // (mesh.pp * mesh.tp)
    config.parallelism.data_parallel_shard_degree = dp
    config.parallelism.tensor_parallel_degree = mesh.tp
    config.parallelism.pipeline_parallel_degree = mesh.pp
    # DTensor on the model-parallel axes, FSDP2 over dp. The default ("spmd_types") refuses FSDP2 over dp = 2 here:
    # "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh" (not diagnosed)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len = SEQ
    config.training.local_batch_size = 1  # rows per micro-batch are the harness's; torchtitan only counts them
    config.training.global_batch_size = spec.accum_steps * dp  # -> gradient_accumulation_steps = N
    config.training.mixed_precision_param = DTYPE_NAMES[spec.dtype]  # FSDP2 computes in the run's dtype
    config.debug.seed = spec.seed
    # its CrossEntropyLoss unchunked: the debug config's ChunkedLossWrapper runs a forward and backward of the lm_head
    # per chunk inside the loss, and verify.Pull tells micro-steps apart by one forward-backward each
    config.loss = config.loss.loss_fn
    if spec.device == "cpu":
        # FlexAttention has no backward on the CPU (torch raises); torchtitan's SDPA inner attention, causal, is
        # the same attention for these rows of one document each (its flex mask is block-causal per document)
        for _, _, parent, attr in config.model_spec.model.traverse(FlexAttention.Config):
            setattr(parent, attr, ScaledDotProductAttention.Config())

    t = Trainer.__new__(Trainer)
    t.config = config
    t.device = torch.device("cpu") if spec.device == "cpu" else torch.device(spec.device)
    t.parallel_dims = ParallelDims.from_config(config.parallelism, world)
    t.parallel_dims.build_mesh()
    dist_utils.set_determinism(t.parallel_dims, t.device, config.debug, distinct_seed_mesh_dims=["pp"])
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_spec = config.model_spec
    t.model_config = model_spec.model
    t.model_config.update_from_config(config=config)
    with torch.device("meta"), utils.set_default_dtype(spec.dtype):
        model = t.model_config.build()
    t.loss_fn = config.loss.build(compile_config=config.compile)
    model = model_spec.parallelize_fn(model, parallel_dims=t.parallel_dims, training=config.training,
                                      parallelism=config.parallelism, compile_config=config.compile,
                                      ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    if dist.get_backend() == "gloo":
        # torchtitan sums over dp (gradient_divide_factor 1.0), which FSDP2 sends as PREMUL_SUM(1.0), an op gloo
        # lacks; forced, FSDP2 sends SUM and divides by nothing: the same sum
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=t.device)
    # As torchtitan's seed checkpoint: the full model initialised in one piece, then loaded into the shards. (Sharded
    # init_weights draws each shard from the same CPU generator: DTensor's RNG tracker is CUDA's.) Drawn in float32
    # for every dtype, then cast: float64 draws are other numbers, and the reference must start from the same weights
    with torch.device("meta"), utils.set_default_dtype(torch.float32):
        whole = t.model_config.build()
    whole.to_empty(device=t.device)
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        whole.init_weights(buffer_device=None)
        model.init_weights(buffer_device=None)  # the buffers (RoPE's)
        full = dict(whole.named_parameters())
        for name, p in model.named_parameters():
            w = full[name.replace("_checkpoint_wrapped_module.", "")]
            if isinstance(p, DTensor):  # every rank holds the whole model: its shard, cut here (no collective)
                w = distribute_tensor(w, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(w)
    model.train()
    t.model_parts = [model]
    t.optimizers = config.optimizer.build(model_parts=t.model_parts)
    t.lr_schedulers = config.lr_scheduler.build(optimizers=t.optimizers, training_steps=config.training.steps)
    t.gradient_accumulation_steps = config.training.global_batch_size // (config.training.local_batch_size * dp)
    t.num_pipeline_parallel_microbatches = 1
    t.metrics_processor = Logged()
    t.checkpointer = NoCheckpoint()
    t.train_context = dist_utils.get_spmd_context(parallel_dims=t.parallel_dims, spmd_typechecking=False)
    t.fwd_bwd_fn = t._forward_backward_body
    t.step = 0
    t.ntokens_seen = 0
    return t


def batch(x, y):
    """A micro-batch as torchtitan's dataloader yields it: ({"input": tokens, "positions": ...}, labels), labels
    already shifted; each row one document (its flex attention builds the causal block mask from the positions)."""
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    return {"input": x, "positions": positions}, y


class Loop:
    """torchtitan's train loop without its checkpoints, validation and profiler: one train_step per window."""

    def __init__(self, trainer, dataset):
        self.trainer = trainer
        self.dataset = dataset

    def micro_batches(self):
        i = 0
        while True:
            yield self.dataset[i]
            i += 1

    def run(self):
        data = self.micro_batches()
        while True:
            self.trainer.step += 1
            self.trainer.train_step(data)


class Adapter:
    """The Pull's four methods; the step loss is the one torchtitan logs (its global token mean over dp)."""

    def __init__(self, spec):
        self.titan = build(spec)
        self.pull = verify.Pull(spec, batch=batch)
        self.pull.start(Loop(self.titan, self.pull.dataset).run, self.titan.model_parts[0])

    def micro_step(self, x, y, micro):
        self.pull.micro_step(x, y, micro)

    def grads(self):
        return self.pull.grads()

    def optimizer_step(self):
        self.pull.optimizer_step()
        return self.titan.metrics_processor.step["loss"]

    def metrics(self):
        self.pull.metrics()
        return self.titan.metrics_processor.step

    def params(self):
        return self.pull.params()


def counts(case):
    """torchtitan never pauses FSDP2's gradient sync: every micro-step all-gathers its 8 fully_shard units (the 6
    blocks, the embedding, the root) for the forward, 7 again for the backward (all but the root reshard after
    forward), and reduce-scatters the 8. The boundary adds the window's valid-token count (int64), the gradient
    norm, the logged loss's sum and max and tokens seen, and verify.Pull's loss. At dp = 1 no collective."""
    if case.world == 1:
        return verify.CountRow("FSDP2, one rank", before={}, boundary={})
    micro = {"all_gather": 15, "reduce_scatter": 8}
    return verify.CountRow("FSDP2", before=micro, boundary={**micro, "all_reduce": 6})


# empty_windows=False: a window without a valid target is 0/0 in torchtitan's global mean, and its train_step stops
# training on the non-finite loss ("Loss is not finite ... Stopping training"), a guard by design: not drawn
factory = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ),
                         batches=verify.Batches(ignore_index=IGNORE_INDEX, empty_windows=False),
                         distributed=verify.Distributed(process_group=True, counts=counts))(Adapter)
