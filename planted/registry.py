"""The one registry of planted bugs: every deliberately broken trainer of broken*.py and ddp_modes.py, the
gate that must reject it, what its message must say, and a case where the bug exists.

    PlantedBug(name, what, adapter, gate, pattern, case, args=(), slow=False, knobs=())

`gate` is the Gate whose GateFailure must reject the bug (`GateFailure.gate`), "memory" for
verify.memory's peak-memory verdict, or "launcher" for a failure only a launched world shows (verify.run; driven by
tests/examples/test_launcher.py, and test_launched_pool.py for a sub-world's). tests/harness/test_planted.py drives every entry through its gate (the one
parametrized test), and checks docs/design.md's table of planted bugs against this registry; the
drawn-case tests of each gate (tests/harness/test_gates_*.py, test_tokens.py, ...) take their bugs from
here too (`of_gate`). A planted bug is one hook on xtrain's trainer (template.py).

Controls, harmless by design and checked to PASS where they are tested: broken.scaled_by_one (× 1.0 at
N = 1) and broken_dist.fsdp2_switch_after_forward (FSDP2 reads the switch after the backward).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from xtrain_core.config import ModelConfig, OptimConfig

from verify import Adapter, Case, Gate, Mesh
from verify.study import mesh_padding
from planted import (broken, broken_dist, bucket_adapters, broken_lowprec, broken_mesh, broken_mesh_metrics, broken_metrics, broken_numerics,
                     broken_overflow, broken_tokens, broken_tp, calib_adapters, count_adapters, cp_adapters, ddp_modes,
                     hint_adapters, hsdp_adapters,
                     moe_adapters, objective_adapters, overflow_adapters, packed_adapters, parity_adapters, pull_loops,
                     scale_adapters, short_adapters, uneven_adapters, zero_adapters,
                     zero_grad_adapters)
from planted import broken_amp_metrics  # issue 42 item 3: metrics in every precision
from planted import atstep_adapters  # issue 42, the zoo's grads_from="optimizer" classes (optgrads)
from xtrain_proof.options import XtrainOptions
from examples import ddp_no_sync, llama_scale


@dataclass(frozen=True)
class PlantedBug:
    name: str
    what: str
    """The bug in a few words (the docs' table)."""
    adapter: Adapter | Callable[[], Adapter]
    """The adapter, or a function returning it (for an optional framework, imported only when the row runs)."""
    gate: Gate | str
    pattern: str
    """A regular expression the rejection message must contain (re.search)."""
    case: Case | None
    """A case where the bug exists, so the gate must reject it there (None: gate "memory", driven by
    tests/test_memory.py through the CLI)."""
    args: tuple = ()
    """The gate's further arguments: overflow (micro-step, rank); split invariance (max_world,)."""
    slow: bool = False
    needs: str = ""
    """A module the adapter needs (an optional framework); without it the bug is not run."""
    knobs: tuple = ()
    """(Settings field, value) pairs the case runs under (verify/_internal/settings.py's KNOBS), e.g. emulated nodes."""

    def __post_init__(self):
        if not self.pattern:
            raise ValueError(f"PlantedBug {self.name}: pattern is empty; name what the rejection must say")

    def load(self) -> Adapter:
        """The adapter; a row whose framework is optional holds a function that imports it when asked."""
        if isinstance(self.adapter, Adapter):
            return self.adapter
        return self.adapter()

    @property
    def module(self) -> str:
        """The file of planted/ its trainer lives in, without importing an optional framework."""
        if isinstance(self.adapter, Adapter):
            return self.adapter.factory.__module__.rsplit(".", 1)[-1]
        return self.adapter.module

    @property
    def trainer(self) -> str:
        """The trainer class, as `module.Class` (the docs' table names it); a lazy row's adapter as `module.name`,
        named without importing its framework."""
        if not isinstance(self.adapter, Adapter):
            return f"{self.adapter.module}.{self.adapter.attr}"
        make = self.load().factory
        return f"{make.__module__.rsplit('.', 1)[-1]}.{make.__name__.removeprefix('make_')}"


def _lazy(module: str, name: str):
    """A row whose framework is optional (transformers, lightning, accelerate): planted/<module>.py is imported when
    the row runs, so the registry, and the tests collected from it, load without it. `.module` names the file
    without importing it (of_gate filters by it at collection)."""
    def load() -> Adapter:
        return getattr(importlib.import_module(f"planted.{module}"), name)
    load.module, load.attr = module, name
    return load


def _opts(vocab=32, seq=8, layers=1, heads=2, d=16, seq_len=None, **optim):
    model = ModelConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, d_model=d)
    norm = optim.pop("loss_norm", "mean")
    return XtrainOptions(model=model, seq_len=seq_len or seq, optim=OptimConfig(**{"lr": 1e-2, **optim}),
                         loss_norm=norm)


SMALL = _opts(warmup_steps=2)  # warm-up over 2 steps: a schedule that moves (scheduler_step_every_micro)
TINY = _opts(vocab=16, heads=1, d=8, seq_len=4)
TOKENS = _opts(vocab=16, heads=1, d=8, seq_len=4, weight_decay=0.1, warmup_steps=2, loss_norm="tokens")
LONG = _opts(vocab=64, seq=16, heads=1, d=32)

SINGLE = Case(accum_steps=3, micro_batch=2, steps=2, options=SMALL, seed=1, data_seed=2)
# the metrics gate's: clipping bites at 0.05 in every step, a warm-up moves the LR; TOKEN_WINDOWS' padding
METRIC = Case(accum_steps=3, micro_batch=2, steps=2, options=_opts(warmup_steps=2, max_grad_norm=0.05), seed=1,
              data_seed=2)
N1 = Case(accum_steps=1, micro_batch=3, steps=2, options=SMALL, seed=1, data_seed=2)  # B·S = 24: not a power of 2
DIST = Case(accum_steps=3, micro_batch=2, steps=2, world=2, options=SMALL, seed=1, data_seed=2)
DDP = Case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=1, data_seed=2)
# windows A (rows 0-5) and B (rows 6-11) of 4 targets per row: uneven rows, an empty row and micro-batch
TOKEN_WINDOWS = Case(accum_steps=3, micro_batch=2, steps=2, options=TOKENS, seed=1, data_seed=2,
                     lengths=(4, 0, 2, 1, 3, 0, 0, 0, 4, 4, 1, 2))
# one window of 4 rows whose valid counts differ by row, and by rank under the split N=2 B=1 W=2
PADDED = Case(accum_steps=2, micro_batch=2, steps=1, options=TOKENS, seed=1, data_seed=2, lengths=(4, 1, 3, 0))
EMPTY_FSDP = Case(accum_steps=1, micro_batch=1, steps=2, world=2, lengths=(1, 1, 0, 0), options=_opts(
    vocab=8, seq=24, heads=1, d=4, seq_len=1, lr=1e-3, weight_decay=0.0, loss_norm="tokens"))
# data seed 0: an expert used only in micro-step 0 (under no_sync) on some rank (test_ddp_modes.py's _case_with)
ROUTED = Case(accum_steps=2, micro_batch=1, steps=1, world=2)
OVERFLOW = Case(accum_steps=3, micro_batch=2, steps=2, precision="fp16", options=TINY)
# planted/count_adapters.py's windows: uneven valid counts per micro-step and rank
COUNTED = Case(accum_steps=3, micro_batch=1, steps=2, world=2, lengths=(0, 0, 2, 5, 1, 0) + (0, 3, 0, 4, 0, 1))
# two pipeline stages, 2 micro-batches per schedule step, 2 outer steps: where scale_grads' 1/chunks compounds
PIPE = Case(accum_steps=4, micro_batch=2, steps=2, world=1, mesh=Mesh(pp=2), pipeline_chunks=2, seed=1, data_seed=2)
# two tp ranks, N=3 (so loss × tp, error 1 = tp − 1, is not N − 1), B=4; data seed 1: every micro-batch holds
# targets of both class shards (shard_local_count divides by no zero: a finite, rank-dependent loss)
TP = Case(accum_steps=3, micro_batch=4, steps=2, world=1, mesh=Mesh(tp=2), seed=1, data_seed=1)
# DIST clipping at 0.2: each rank's own gradient and the reduced one clip (at 1.0 neither does, only a log can be wrong)
CLIPPED = DIST.replace(options=_opts(warmup_steps=2, max_grad_norm=0.2))
# windows A and B of planted/objective_adapters.py (rows of 6 targets): an empty row, rows of every length
# uneven windows (uneven_adapters.py): rank 1 holds 4 rows in 2 micro-steps, rank 0 6 in 3; UNEVEN_SHORT: rank 1 one
UNEVEN = Case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=1, data_seed=2, rank_rows=((2, 2, 2), (3, 1)))
UNEVEN_SHORT = Case(accum_steps=2, micro_batch=2, steps=1, world=2, seed=1, data_seed=2, rank_rows=((2, 2), (3,)))
OBJECTIVE = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2,
                 lengths=(6, 1, 2, 0, 3, 5, 2, 3, 4, 4, 1, 2, 6, 6, 5, 0, 3, 6, 2, 1, 4, 6, 6, 6))
# windows A and B of planted/packed_adapters.py (packed rows of 12 targets, 1-3 documents): empty rows, trailing
# documents emptied by the padding, rows of every length
PACKED = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2,
              lengths=(12, 3, 7, 0, 9, 11, 5, 12, 8, 10, 1, 6, 12, 4, 11, 0, 9, 12, 2, 7, 12, 10, 5, 12))
# the MoE recipe (examples/moe_aux.py) on OBJECTIVE's windows; recomputed in the backward; at 2 ranks
CP = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, mesh=Mesh(cp=2))  # a sequence over 2 ranks
MOE_CKPT = OBJECTIVE.replace(options=moe_adapters.moe_aux.Options(checkpointing=True))
# the padded mesh corners (verify/_internal/cases/corners.py) at N=3: right-padded rows whose padding is the last
# cp rank's, a window where it holds only padding; on dp=2 a micro-batch empty on replica 1
CP_PADDED = CP.replace(lengths=mesh_padding(steps=2, accum_steps=3, micro_batch=2, dp=1, seq_len=8, cp=2))
DP_PADDED = CP.replace(world=2, mesh=Mesh(dp=2),
                       lengths=mesh_padding(steps=2, accum_steps=3, micro_batch=2, dp=2, seq_len=8, cp=1))
MOE_DIST = Case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=1, data_seed=2)

_BEFORE = r"micro-step 0 of \d+: \d+ collective\(s\) before the boundary: "
_FSDP_ROW = r"micro-step 0 of \d+ \(before the boundary\): count table row 'FSDP2"
_SPLIT = r"split N=\d+ B=\d+ W=\d+ of a window of \d+ rows: \["
_EQ = r"; case N=\d"
_NORM = r", step 0: grad_norm reported \S+, expected \S+ \(‖the boundary gradient‖, every element once\) "

PLANTED: tuple[PlantedBug, ...] = (
    # -- one process (broken.py) ---------------------------------------------------------------------------
    PlantedBug("missing_1_over_N", "backward of the raw micro loss: N× the gradient",
               broken.missing_1_over_N, Gate.EQUIVALENCE, _EQ, SINGLE),
    PlantedBug("drawn_in_spec_dtype", "the model drawn in Spec.dtype (other float64 weights), and N× the gradient",
               broken.drawn_in_spec_dtype, Gate.EQUIVALENCE,
               r"the float64 run \(the big batch\) does not start from the float32 run's weights: 'tok.weight'", SINGLE),
    PlantedBug("other_reference", "the float64 runs compute 3× the loss (another objective), and N× the gradient",
               broken.other_reference, Gate.EQUIVALENCE,
               r"the big batch \(fp32\) and its float64 reference differ by 0\.667 over all parameters", SINGLE),
    PlantedBug("zero_grad_in_micro_loop", "zero_grad at the start of every micro-step",
               broken.zero_grad_in_micro_loop, Gate.EQUIVALENCE, _EQ, SINGLE),
    PlantedBug("optimizer_step_every_micro", "optimizer.step() after every micro-step",
               broken.optimizer_step_every_micro, Gate.EQUIVALENCE, _EQ, SINGLE),
    PlantedBug("scheduler_step_every_micro", "LR scheduler stepped per micro-step",
               broken.scheduler_step_every_micro, Gate.EQUIVALENCE, _EQ, SINGLE),
    PlantedBug("n1_different_reduction", "N == 1: backward of the row SUM, gradient ÷ B·S after it",
               broken.n1_different_reduction, Gate.BIT_EXACT,
               r"(gradient|parameter) .+ not bit-identical, max\|Δ\| = \d", N1),
    PlantedBug("writes_into_targets", "`targets[:, 0] = -100` in place before its loss",
               broken.writes_into_targets, Gate.BIT_EXACT,
               r"the trainer wrote into its targets \(step 0, micro-step 0 of \d+\)", N1),
    PlantedBug("leaky_graph", "every micro-step's graph kept until the boundary (retain_graph)",
               broken.leaky_graph, "memory", r"verdict: FAIL", None),
    # -- what a trainer reports (broken_metrics.py): the metrics gate ---------------------------------------
    PlantedBug("norm_of_last_micro", "grad_norm of the last micro-step's gradient",
               broken_metrics.norm_of_last_micro, Gate.REPORTED_METRICS,
               r"the accumulation run, step 0: grad_norm reported 1\.08\d+, expected 0\.709\d+ .* \(×1\.53", METRIC),
    PlantedBug("norm_after_clip", "grad_norm after clipping, declared before",
               broken_metrics.norm_after_clip, Gate.REPORTED_METRICS, r"grad_norm reported .* \(= the norm after clipping\)", METRIC),
    PlantedBug("norm_after_zero_grad", "grad_norm read after zero_grad: 0 (FSDP2 + accumulation)",
               broken_metrics.norm_after_zero_grad, Gate.REPORTED_METRICS, r"grad_norm reported 0\.0, .* \(zero\)", METRIC),
    PlantedBug("lr_before_scheduler_step", "lr read before the scheduler's step, declared after it",
               broken_metrics.lr_before_scheduler_step, Gate.REPORTED_METRICS,
               r"lr reported .* \(= the LR applied, read before the scheduler's step\)", METRIC),
    PlantedBug("tokens_of_one_micro", "the valid-token count of one micro-step",
               broken_metrics.tokens_of_one_micro, Gate.REPORTED_METRICS,
               r"tokens reported 3\.0, expected 10\.0 .* \(= micro-step \d's count on this rank\)", TOKEN_WINDOWS.replace(options=_opts(
                   vocab=16, heads=1, d=8, seq_len=4, warmup_steps=2, loss_norm="tokens"))),
    PlantedBug("loss_of_last_micro", "the last micro-batch's loss logged as the window's",
               broken_metrics.loss_of_last_micro, Gate.REPORTED_METRICS,
               r"loss reported .* \(= the loss of this rank's last micro-batch\)", METRIC),
    PlantedBug("partial_norm_clip", "the clip coefficient from the norm before the last micro-step",
               broken_metrics.partial_norm_clip, Gate.REPORTED_METRICS, r"the clip coefficient applied: .* gives", METRIC),
    # -- data parallel (broken_dist.py) ----------------------------------------------------------------------
    PlantedBug("all_reduce_every_micro_step", "an all-reduce after every micro-step (no no_sync)",
               broken_dist.all_reduce_every_micro, Gate.BOUNDARY_ONLY,
               _BEFORE + r"\S+:all_reduce", DIST),
    PlantedBug("all_reduce_in_helper_thread", "the early all-reduce in a helper thread",
               broken_dist.all_reduce_in_helper_thread, Gate.BOUNDARY_ONLY,
               _BEFORE + r".*all_reduce", DIST),
    PlantedBug("all_reduce_on_backend_object", "the early all-reduce on the c10d backend object",
               broken_dist.all_reduce_on_backend_object, Gate.BOUNDARY_ONLY,
               _BEFORE + r".*all_reduce", DIST),
    PlantedBug("all_reduce_on_private_group", "the early all-reduce on a private process group",
               broken_dist.all_reduce_on_private_group, Gate.BOUNDARY_ONLY,
               _BEFORE + r".*all_reduce.* process group [1-9]", DIST),
    PlantedBug("no_all_reduce", "never communicates", broken_dist.no_all_reduce, Gate.BOUNDARY_ONLY,
               r"boundary \(micro-step \d+ of \d+, .*\): no gradient all-reduce", DIST),
    PlantedBug("dist_other_reference", "right in float32; the float64 reference at one rank computes 3× the loss",
               broken_dist.other_reference, Gate.DP_EQUIVALENCE,
               r"the big batch \(fp32\) and its float64 reference differ by 0\.667 over all parameters", DIST),
    PlantedBug("divide_by_world_twice", "gradient ÷ W twice",
               broken_dist.divide_by_world_twice, Gate.DP_EQUIVALENCE,
               r"gradient \(step 0\) of .*: accumulation error .* the boundary's collectives \(step 0, micro-step \d+ "
               r"of \d+ .*\): \S+:all_reduce", DIST),
    PlantedBug("reduce_some_params", "reduces the blocks' gradients only",
               broken_dist.reduce_some_params, Gate.BOUNDARY_ONLY,
               r"boundary \(micro-step \d+ of \d+, .*\): gradient collectives cover \d+ of \d+ gradient elements", DIST),
    PlantedBug("broadcast_params_every_micro", "parameters re-broadcast after every micro-step",
               broken_dist.broadcast_params_every_micro, Gate.BOUNDARY_ONLY,
               _BEFORE + r"\S+:broadcast float32", DIST),
    PlantedBug("int_view_checksum_every_micro", "the gradient's bytes all-reduced as int32 every micro-step",
               broken_dist.int_view_checksum_every_micro, Gate.BOUNDARY_ONLY,
               _BEFORE + r"\S+:all_reduce int32", DIST),
    PlantedBug("ddp_sync_flag_after_forward", "DDP's require_backward_grad_sync set after the forward",
               broken_dist.ddp_sync_flag_after_forward, Gate.BOUNDARY_ONLY,
               _BEFORE + r"\S+:all_reduce", DIST),
    PlantedBug("ddp_no_sync_around_backward_only", "DDP's no_sync() around the backward only",
               broken_dist.ddp_no_sync_around_backward_only, Gate.BOUNDARY_ONLY,
               _BEFORE + r"\S+:all_reduce", DIST),
    PlantedBug("fsdp2_sync_always", "FSDP2's gradient sync never turned off",
               broken_dist.fsdp2_sync_always, Gate.BOUNDARY_ONLY,
               _FSDP_ROW + r", reshard after forward, \d+ units' expects all_gather×\d+, observed all_gather×\d+, "
               # gloo reduces by all-reduce, NCCL by reduce-scatter (the row knows which)
               r"(all_reduce×\d+: gloo:all_reduce float32|.*reduce_scatter×\d+.*nccl:_?reduce_scatter\w* float32)", DIST),
    PlantedBug("fsdp2_switch_after_backward", "FSDP2's sync switch set after the backward",
               broken_dist.fsdp2_switch_after_backward, Gate.BOUNDARY_ONLY, _FSDP_ROW, DIST),
    PlantedBug("fsdp2_steps_empty_windows", "FSDP2 steps a window without a valid token",
               broken_dist.fsdp2_steps_empty_windows, Gate.BOUNDARY_ONLY,
               r"step 1, boundary .*a window without a valid token: no update\): count table row", EMPTY_FSDP),
    # a rank that dies mid-step under `python -m verify.run`: torchrun's failure message names its exit code
    PlantedBug("dies_mid_step", "rank 1 ends its process at its second micro-step (os._exit(17))",
               broken_dist.dies_mid_step, "launcher", r"exitcode\s*:\s*17", DIST),
    # declares subgroups, reduces over the default group: in a launched sub-world (tests/harness/test_launched_pool.py)
    PlantedBug("ignores_spec_group", "declares subgroups=True, reduces over the default group",
               broken_dist.ignores_spec_group, "launcher",
               r"issued [\w, ]*all_?reduce[\w, ]* on the default group \(all \d+ ranks\) instead of Spec\.group", DIST),
    # -- torch DDP's options (ddp_modes.py): the message names the count table row -------------------------
    PlantedBug("find_unused_sync_around_backward_only", "find_unused DDP, no_sync() around the backward only",
               ddp_modes.find_unused_sync_around_backward_only,
               Gate.BOUNDARY_ONLY, r"micro-step 0 of .*before the boundary.*count table row 'find_unused'", DDP),
    PlantedBug("compiled_sync_around_backward_only", "compiled DDP, no_sync() around the backward only",
               ddp_modes.compiled_sync_around_backward_only, Gate.BOUNDARY_ONLY,
               r"micro-step 0 of .*before the boundary.*count table row 'compiled'", DDP, slow=True),  # compile: ~5 s
    PlantedBug("find_unused_with_plain_row", "find_unused DDP checked against bucket_view's row",
               ddp_modes.find_unused_with_plain_row, Gate.BOUNDARY_ONLY,
               r"boundary.*count table row 'bucket_view'.*all_reduce int32", DDP),
    PlantedBug("reference_row_undeclared", "a float64 reference synced every micro-step, its row undeclared",
               ddp_modes.reference_row_undeclared, Gate.BOUNDARY_ONLY,
               r"\(float64 run\), step 0, micro-step 0 of .*before the boundary.*count table row 'bucket_view'", DDP),
    PlantedBug("router_drops_stale_expert", "a router drops an expert's accumulated gradient",
               ddp_modes.router_drops_stale_expert, Gate.DP_EQUIVALENCE,
               r"gradient \(step 0\) of '[ab]\.0\.(weight|bias)'", ROUTED),
    PlantedBug("bucket_view_ignores_head_bias", "head.bias left out of DDP",
               ddp_modes.bucket_view_ignores_head_bias, Gate.BOUNDARY_ONLY,
               r"the reductions carry \d+ floating elements, count table row 'bucket_view' expects", DDP),
    # -- token weighting, mixed precision, long windows (broken_numerics.py) ----------------------------------
    PlantedBug("per_micro_mean", "CE mean per micro-batch × 1/N on padded data",
               broken_numerics.per_micro_mean, Gate.SPLIT_INVARIANCE, _SPLIT, PADDED, (2,)),
    PlantedBug("count_divided_twice", "accumulated sum ÷ the token count twice",
               broken_numerics.count_divided_twice, Gate.SPLIT_INVARIANCE, _SPLIT, PADDED, (2,)),
    PlantedBug("count_from_first_micro", "token count taken as N × micro-step 0's",
               broken_numerics.count_from_first_micro, Gate.SPLIT_INVARIANCE, _SPLIT, PADDED,
               (2,)),
    PlantedBug("per_rank_mean", "each rank ÷ its own token count, then ÷ W",
               broken_numerics.per_rank_mean, Gate.SPLIT_INVARIANCE, _SPLIT, PADDED, (2,)),
    PlantedBug("unscale_update_every_micro", "scaler.unscale_() + update() after every micro-step",
               broken_numerics.unscale_update_every_micro, Gate.EQUIVALENCE, _EQ,
               SINGLE.replace(precision="fp16")),
    PlantedBug("manual_unscale_every_micro", "gradient ÷ the loss scale by hand every micro-step",
               broken_numerics.manual_unscale_every_micro, Gate.EQUIVALENCE, _EQ,
               SINGLE.replace(precision="fp16")),
    PlantedBug("bf16_accumulation_buffer", "gradients summed in a bf16 buffer",
               broken_numerics.bf16_accumulation_buffer, Gate.EQUIVALENCE,
               r"gradient \(step 0\)", Case(accum_steps=256, micro_batch=1, steps=1, options=LONG, precision="bf16",
                                            seed=3, data_seed=4), slow=True),
    PlantedBug("drop_micro_63", "micro-step 63 never backwards (N ≥ 64)", broken_numerics.drop_micro_63,
               Gate.PARTIAL_SUMS,
               r"after micro-step 63 of 96 \(boundary not reached\)",
               Case(accum_steps=96, micro_batch=1, steps=1, options=TINY, seed=1, data_seed=2), slow=True),
    PlantedBug("doubling_buffer", "the accumulated gradient doubles before each micro-step",
               broken_numerics.doubling_buffer, Gate.PARTIAL_SUMS, r"after micro-step 1 of 70",
               Case(accum_steps=70, micro_batch=1, steps=2, seed=5, data_seed=6,
                    options=_opts(vocab=16, heads=1, d=8, seq_len=4, max_grad_norm=0.01))),
    # -- low-precision accumulation (broken_lowprec.py) ---------------------------------------------------------
    PlantedBug("half_model", "fp16 model (`.half()`): `.grad` accumulates in fp16",
               broken_lowprec.half_model, Gate.LONG_WINDOW,
               r"fp16, N=4: \[equivalence\] gradient \(step 0\) of '[\w.]+' is torch.float16 at the boundary",
               Case(accum_steps=4, micro_batch=1, steps=1, options=TINY, precision="fp16", seed=1, data_seed=2)),
    PlantedBug("bf16_params", "bf16 model: `.grad` accumulates in bf16", broken_lowprec.bf16_params, Gate.LONG_WINDOW,
               r"bf16, N=4: \[equivalence\] gradient \(step 0\) of '[\w.]+' is torch.bfloat16 at the boundary",
               Case(accum_steps=4, micro_batch=1, steps=1, options=TINY, precision="bf16", seed=1, data_seed=2)),
    PlantedBug("low_precision_grad", "`.grad` rounded to bf16 / fp16 after every micro-step",
               broken_lowprec.low_precision_grad, Gate.LONG_WINDOW,
               r"bf16, N=256: \[equivalence\] gradient \(step 0\) of '[\w.]+': accumulation error",
               Case(accum_steps=256, micro_batch=1, steps=1, options=LONG, seed=3, data_seed=4), slow=True),
    PlantedBug("fp16_grad_buffer", "`.grad` rounded to fp16 after every micro-step: under the equivalence policy",
               broken_lowprec.fp16_grad_buffer, Gate.LONG_WINDOW,
               r"fp16, N=16: the boundary gradient moves by [\d.e+-]+ \(relative, all parameters\) when the window's "
               r"micro-batches run in reverse order",
               Case(accum_steps=16, micro_batch=1, steps=1, options=TINY, precision="fp16", seed=1, data_seed=2)),
    # -- the overflow path (broken_overflow.py): args (micro-step, rank) of the injected overflow; the message
    # names the window and rank that went wrong, and where the overflow was injected
    PlantedBug("skip_decided_on_one_rank", "the overflow skip decided on rank 0 alone",
               broken_overflow.skip_decided_on_one_rank, Gate.OVERFLOW,
               r"rank 1, window 0: parameter(?s:.*)overflows in micro-step 1 of 3 on rank 1 of 2",
               OVERFLOW.replace(world=2), (1, 1)),
    PlantedBug("skip_only_overflowing_micro", "only the overflowing micro-step dropped",
               broken_overflow.skip_only_overflowing_micro, Gate.OVERFLOW,
               r"rank 0, window 0: parameter(?s:.*)overflows in micro-step 1 of 3 on rank 0 of 1", OVERFLOW, (1, 0)),
    PlantedBug("scaler_update_every_micro", "the loss scale updated every micro-step",
               broken_overflow.scaler_update_every_micro, Gate.OVERFLOW,
               r"rank 0, window 0: loss scale 128 after the window, the big batch's 512(?s:.*)"
               r"overflows in micro-step 0 of 3 on rank 0 of 1", OVERFLOW, (0, 0)),
    PlantedBug("nan_to_num_before_check", "inf / NaN zeroed before the scaler's check",
               broken_overflow.nan_to_num_before_check, Gate.OVERFLOW,
               r"rank 0, window 0: parameter(?s:.*)overflows in micro-step 2 of 3 on rank 0 of 1", OVERFLOW, (2, 0)),
    # a hand-written loop without an overflow= hook (the harness injects), token and float data: the overflow on a
    # rank other than 0 (the corner every profile draws first) is stepped on by every rank
    PlantedBug("found_inf_of_rank_0_tokens", "found_inf of rank 0's own gradient broadcast, token data",
               broken_overflow.found_inf_of_rank_0_tokens, Gate.OVERFLOW,
               r"rank 0, window 0: parameter '[\w.]+' changed(?s:.*)overflows in micro-step 2 of 3 on rank 1 of 2",
               OVERFLOW.replace(world=2, options=None), (2, 1)),
    PlantedBug("found_inf_of_rank_0_float", "found_inf of rank 0's own gradient broadcast, float data",
               broken_overflow.found_inf_of_rank_0_float, Gate.OVERFLOW,
               r"rank 0, window 0: parameter '[\w.]+' changed(?s:.*)overflows in micro-step 2 of 3 on rank 1 of 2",
               OVERFLOW.replace(world=2, options=None), (2, 1)),
    # -- the token mean and empty windows (broken_tokens.py) ---------------------------------------------------
    PlantedBug("all_positions", "÷ every target position, padding included",
               broken_tokens.all_positions, Gate.NORMALISER, r"additivity|padding", TOKEN_WINDOWS),
    PlantedBug("count_plus_one", "÷ (valid count + 1)",
               broken_tokens.count_plus_one, Gate.NORMALISER, r"additivity", TOKEN_WINDOWS),
    PlantedBug("sequences", "÷ the number of sequences with a valid target",
               broken_tokens.sequences, Gate.NORMALISER, r"additivity", TOKEN_WINDOWS),
    PlantedBug("empty_div_by_zero", "an empty window ÷ 0: NaN, stepped",
               broken_tokens.empty_div_by_zero, Gate.EMPTY_WINDOW,
               r"a window without a valid target \(after window A, 10 valid targets\) changed parameter '.+': "
               r"max\|Δ\| = nan \(NaN", TOKEN_WINDOWS),
    PlantedBug("empty_stepped", "an empty window stepped on its zero gradient",
               broken_tokens.empty_stepped, Gate.EMPTY_WINDOW,
               r"a window without a valid target .* max\|Δ\| = \d", TOKEN_WINDOWS),
    # -- mesh axes (broken_mesh.py: a GPipe MLP on torch.distributed.pipelining) ------------------------------
    PlantedBug("scale_grads_ema", "schedule scale_grads=True under outer accumulation (torchtitan #1733)",
               broken_mesh.pipe_ema, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=2 tp=1, chunks=2, outer=2: gradient \(step 0\) of '\d\.\w+' \(stage [01]\)", PIPE),
    PlantedBug("scale_grads_ema_over_meshes", "the same, found by running one window on every mesh of 2 ranks",
               broken_mesh.pipe_ema, Gate.MESH_SPLIT_INVARIANCE,
               r"^\[mesh split invariance\] mesh dp=1 pp=2 tp=1 of a window of 8 rows: \[mesh equivalence\] ",
               Case(accum_steps=4, micro_batch=2, steps=1, pipeline_chunks=2, seed=1, data_seed=2), (2,)),
    PlantedBug("owned_twice", "a stage reports a parameter of the next stage as its own",
               broken_mesh.pipe_owned_twice, Gate.MESH_EQUIVALENCE,
               r"replica 0: gradient \(step 0\) of '8.weight' owned twice, by stage 0 and stage 1", PIPE),
    PlantedBug("no_loss", "the last stage returns no step loss",
               broken_mesh.pipe_no_loss, Gate.MESH_EQUIVALENCE,
               r"replica 0: the last stage \(stage 1\) returned no loss", PIPE),
    PlantedBug("pp_chatter", "an all-reduce over pp after every schedule step",
               broken_mesh.pipe_pp_chatter, Gate.BOUNDARY_ONLY,
               r"axis pp .*: step 0, outer step 0 of 2 \(before the boundary\): count table row 'GPipe stage \d of 2' "
               r"expects recv×\d+, send×\d+, observed all_reduce×1", PIPE),
    PlantedBug("stage_rescales_received", "every stage but the last ÷ N its output's gradient again (DeepSpeed #8154)",
               broken_mesh.pipe_rescales_received, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=3 tp=1, chunks=2, outer=2: gradient \(step 0\) of '\d\.\w+' \(stage [01]\)",
               PIPE.replace(mesh=Mesh(pp=3))),
    PlantedBug("stage_grads_wiped", "param.grad = None before every schedule step (NeMo Automodel #3530)",
               broken_mesh.pipe_grads_wiped, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=2 tp=1, chunks=2, outer=2: gradient \(step 0\) of '\d\.\w+' \(stage [01]\)", PIPE),
    PlantedBug("earlier_stage_divides_again", "the loss ÷ N on the last stage, the gradient ÷ N again on an earlier one",
               broken_mesh.pipe_divides_again, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=2 tp=1, chunks=2, outer=2: gradient \(step 0\) of '[02]\.\w+' \(stage 0\)", PIPE),
    PlantedBug("world_barrier", "a barrier on the world group every micro-step", broken_mesh.pipe_world_barrier,
               Gate.BOUNDARY_ONLY, r"outer step 0 of 2: 1 collective\(s\) on no mesh axis: gloo:barrier",
               PIPE.replace(accum_steps=2, pipeline_chunks=1, world=2, mesh=Mesh(dp=2, pp=2))),
    PlantedBug("tp_extra_reduce", "the micro loss all-reduced over tp too", broken_mesh.tp_extra_reduce,
               Gate.BOUNDARY_ONLY, r"axis tp .*count table row 'Colwise/Rowwise MLP' expects all_reduce×1, "
               r"observed all_reduce×2", PIPE.replace(pipeline_chunks=1, mesh=Mesh(tp=2))),
    PlantedBug("eager_dp", "the dp all-reduce on every micro-step", broken_mesh.tp_eager_dp, Gate.BOUNDARY_ONLY,
               r"axis dp .*count table row 'dp: boundary-only' expects none, observed all_reduce×\d",
               PIPE.replace(pipeline_chunks=1, world=2, mesh=Mesh(dp=2))),
    # -- small MLPs and framework recipes (planted/*_adapters.py, pull_loops.py, framework_bugs.py) ---
    PlantedBug("off_by_1e5", "accumulation 1e-5 off, beside a float32 constant",
               calib_adapters.off_by_1e5, Gate.EQUIVALENCE, _EQ,
               Case(accum_steps=3, micro_batch=2, steps=1)),
    PlantedBug("per_rank_undeclared", "Accelerate's scheduler stepped per rank, undeclared",
               calib_adapters.per_rank_undeclared, Gate.DP_EQUIVALENCE,
               r"rank 0: (.*(loss|parameter).* after step [12]|(float64|step-[12]))",
               Case(accum_steps=2, micro_batch=2, steps=3, world=2, seed=2, data_seed=3)),
    PlantedBug("per_rank_unemulated", "the same, declared, its reference ignoring Spec.schedule_world",
               calib_adapters.per_rank_unemulated, Gate.DP_EQUIVALENCE,
               r"rank 0: (.*(loss|parameter).* after step [12]|(float64|step-[12]))",
               Case(accum_steps=2, micro_batch=2, steps=3, world=2, seed=2, data_seed=3)),
    PlantedBug("count_reduced_undeclared", "the token count all-reduced every micro-step, undeclared",
               count_adapters.undeclared, Gate.BOUNDARY_ONLY,
               r"micro-step 0 of 3: 1 collective\(s\) before the boundary: \S+:all_?reduce int64 \[1\]", COUNTED),
    PlantedBug("declared_at_world_1_only", "the same, declared for world 1 only",
               count_adapters.declared_at_world_1_only, Gate.BOUNDARY_ONLY,
               r"micro-step 0 of 3: 1 collective\(s\) before the boundary", COUNTED),
    PlantedBug("logs_each_micro_loss", "N scalar all-reduces at the boundary",
               count_adapters.logs_each_micro_loss, Gate.BYTES_PER_STEP,
               r"rank 0 \(float32 run\), step 0: the boundary moves \d+ B in 4 gradient collective\(s\) at N=3, \d+ B "
               r"in 2 at N=1", COUNTED.replace(steps=1, lengths=COUNTED.lengths[:6])),
    # world 4 as 2 emulated nodes × 2 ranks: the inter-node reduction belongs at the boundary only
    PlantedBug("hsdp_eager_inter_node", "HSDP: the cross-node all-reduce on every micro-step too",
               hsdp_adapters.eager_inter, Gate.BOUNDARY_ONLY,
               r"micro-step 0 of 3 \(before the boundary\): count table row 'HSDP: inter-node at the boundary only' "
               r"expects all_reduce@intra-node×1, observed all_reduce@inter-node×1, all_reduce@intra-node×1: "
               r"\S+:all_reduce float32 .*\(inter-node\)",
               Case(accum_steps=3, micro_batch=1, steps=1, world=4), knobs=(("ranks_per_node", 2),)),
    PlantedBug("local_clean", "ranks ≥ 1 zero their own inf before the all-reduce",
               overflow_adapters.local_clean, Gate.OVERFLOW,
               r"rank 0, window 0: parameter '0.weight' changed",
               Case(accum_steps=3, micro_batch=2, steps=2, world=2, precision="fp16"), (1, 1)),
    PlantedBug("pull_times_n", "a framework-owned loop without the 1/N, clipping on",
               pull_loops.times_n, Gate.EQUIVALENCE, r"(loss|gradient).*accumulation error 3",
               Case(accum_steps=4, micro_batch=2, steps=1)),
    PlantedBug("hf_per_micro_batch_mean", "HF Trainer before 4.46: each micro-batch's token mean ÷ N",
               _lazy("framework_bugs", "hf_per_micro_batch_mean"), Gate.EQUIVALENCE, r"(loss|gradient)",
               Case(accum_steps=2, micro_batch=1, steps=1, lengths=(8, 2)), needs="transformers"),
    PlantedBug("lightning_over_n_twice", "Lightning: the loss ÷ accumulate_grad_batches by hand too",
               _lazy("framework_bugs", "lightning_over_n_twice"), Gate.EQUIVALENCE,
               r"(loss|gradient).*accumulation error 6\.6", Case(accum_steps=3, micro_batch=2, steps=2),
               needs="lightning"),
    # -- tensor parallel (broken_tp.py: examples/tensor_parallel.py's trainer, one normaliser changed) ----------
    PlantedBug("shard_local_count", "loss ÷ the targets in this tp rank's class shard (Megatron #7513 class)",
               broken_tp.shard_local_count, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=2, chunks=1, outer=3: replica 0, stage 0: tp ranks 0 and 1 (return different "
               r"losses|disagree)", TP),
    PlantedBug("loss_times_tp", "the loss × the tp size (transformers #39648)",
               broken_tp.loss_times_tp, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=2, chunks=1, outer=3: gradient \(step 0\) of '\d\.\w+': accumulation error 1\.0", TP),
    # the default group spans the tp axis here (dp=1): the boundary's extra reductions are tp's (at dp > 1: no axis's)
    PlantedBug("boundary_over_world", "the boundary all-reduce over every rank, tp included (torchtitan #3412 class)",
               broken_tp.boundary_over_world, Gate.BOUNDARY_ONLY,
               r"mesh dp=1 pp=1 tp=2, .*axis tp .*step 0, boundary .*count table row 'Colwise/Rowwise \+ loss parallel' "
               r"expects all_reduce×5, observed all_reduce×11", TP),
    # -- reported metrics across ranks (broken_mesh_metrics.py): a norm or a clip coefficient from part of the gradient
    PlantedBug("replicated_counted_tp", "logged grad_norm: Σg² summed over tp, a replicated bias tp times (NeMo RL #3788)",
               broken_mesh_metrics.replicated_counted_tp, Gate.REPORTED_METRICS,
               r"rank \d: mesh dp=1 pp=1 tp=2 run \(replica 0, stage 0, tp rank \d\)" + _NORM + r"\(×1\.\d+\)", TP),
    PlantedBug("fsdp2_shard_norm", "logged grad_norm over this rank's FSDP2 shards, never all-reduced",
               broken_mesh_metrics.fsdp2_shard_norm, Gate.REPORTED_METRICS, r"rank \d: 2-rank run" + _NORM + r"\(×0\.\d+\)", DIST),
    PlantedBug("clip_before_reduction", "each rank clips its own gradient before the boundary all-reduce",
               broken_mesh_metrics.clip_before_reduction, Gate.DP_EQUIVALENCE,
               r"rank \d: gradient \(step 0\) of '[\w.]+': accumulation error", CLIPPED),
    PlantedBug("clip_coef_per_rank", "the clip coefficient from the norm of this rank's 1/W of the gradient (ZeRO-like)",
               broken_mesh_metrics.clip_coef_per_rank, Gate.DP_EQUIVALENCE,
               r"rank \d: (float64 )?parameter '[\w.]+' after step \d", CLIPPED),
    # -- declared objectives (objective_adapters.py): each term's normaliser -------------------------------------
    PlantedBug("seq_token_weighted", "a token mean where a sequence mean is declared (passes every split)",
               objective_adapters.seq_token_weighted, Gate.NORMALISER,
               r"term 'loss' \(seq_mean.*additivity.*add up with token_mean's weights", OBJECTIVE),
    PlantedBug("seq_nonempty", "÷ the sequences holding a valid target: empty ones dropped (passes every split)",
               objective_adapters.seq_nonempty, Gate.NORMALISER, r"term 'loss' \(seq_mean.*additivity", OBJECTIVE),
    PlantedBug("dr_grpo_own_length", "Dr. GRPO's constant from the micro-batch's longest sequence (verl #3741)",
               objective_adapters.dr_grpo_own_length, Gate.NORMALISER,
               r"term 'loss' \(seq_sum.*one sequence .*by its own length where a constant is declared", OBJECTIVE),
    PlantedBug("micro_token_mean", "each micro-batch's own token mean, then ÷ N (open-instruct #1137, TRL 0.21's bnpo)",
               objective_adapters.micro_token_mean, Gate.NORMALISER,
               r"term 'loss' \(token_mean.*additivity.*at N=3 B=2 window A's loss .*counted over one micro-batch",
               OBJECTIVE),
    PlantedBug("shuffled_micro_token_mean", "the window shuffled, then each micro-batch's own token mean (TRL 0.21)",
               objective_adapters.shuffled_micro_token_mean, Gate.NORMALISER,
               r"term 'loss' \(token_mean.*additivity.*at N=6 B=1 \(at one row per micro-batch.*counted over one "
               r"micro-batch", OBJECTIVE),
    PlantedBug("sum_over_n", "÷ N where a sum is declared",
               objective_adapters.sum_over_n, Gate.NORMALISER, r"term 'loss' \(sum.*add up with row_mean's weights",
               OBJECTIVE),
    PlantedBug("z_missing_over_n", "one term without the 1/N of its sibling (trl PRs #4935, #5828)",
               objective_adapters.z_missing_over_n, Gate.NORMALISER,
               r"term 'z' \(row_mean.*vs the big batch .*\(×3 = N \(micro-steps\)\)", OBJECTIVE),
    PlantedBug("z_over_n_twice", "one term's 1/N applied twice",
               objective_adapters.z_over_n_twice, Gate.NORMALISER,
               r"term 'z' \(row_mean.*vs the big batch .*\(×0\.3333 = 1/N \(micro-steps\)\)", OBJECTIVE),
    # -- the context-parallel axis (cp_adapters.py, on examples/context_parallel.py): the count over dp × cp once --
    PlantedBug("count_over_dp_only", "the valid-target count reduced over dp only: under by cp (verl PR #5993)",
               cp_adapters.count_over_dp_only, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=1 cp=2, .*loss of step 0 \(×2 = cp \(context-parallel ranks\)\)", CP),
    PlantedBug("count_of_whole_rows", "each cp rank counts its rows whole, then over dp × cp: over by cp (prime-rl "
               "PR #2562)", cp_adapters.count_of_whole_rows, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=1 cp=2, .*loss of step 0 \(×0\.5 = 1/cp \(context-parallel ranks\)\)", CP),
    PlantedBug("loss_times_cp", "a leftover × cp_size on the reduced loss and gradient (Megatron #673)",
               cp_adapters.loss_times_cp, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=1 cp=2, .*loss of step 0 \(×2 = cp \(context-parallel ranks\)\)", CP),
    PlantedBug("local_mean_nan", "each cp rank's own token mean: a rank without a valid target gives 0/0 = NaN "
               "(mcore-bridge PR #104)", cp_adapters.local_mean_nan, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=1 cp=2, .*loss of step 0: nan vs the big batch's [\d.]+ \(one of them undefined\)",
               CP.replace(lengths=(3, 4, 2, 1, 4, 3) * 2)),
    # -- path parity (parity_adapters.py): activation checkpointing declared as a switch that must not matter ------
    PlantedBug("rows_counted_in_forward", "the rows counted in a checkpointed forward: twice when the backward recomputes "
               "it (NeMo Automodel PR #3247); each side alone passes every other gate",
               parity_adapters.rows_counted_in_forward, Gate.PATH_PARITY,
               r"activation checkpointing on vs off.*differs \(off vs on\) \(‖on‖ / ‖off‖ = 0\.5\)", OBJECTIVE.replace(
                   lengths=None)),
    # -- packed rows (packed_adapters.py): a per-document mean declared (seq_mean over verify.data.count_documents)
    PlantedBug("pack_mean", "one token mean per packed row, averaged over rows (OpenRLHF PR #923)",
               packed_adapters.pack_mean, Gate.NORMALISER,
               r"term 'loss' \(seq_mean.*additivity.*add up with row_mean's weights", PACKED),
    PlantedBug("pack_mean_per_doc", "one token mean per packed row, ÷ the window's documents (passes additivity)",
               packed_adapters.pack_mean_per_doc, Gate.NORMALISER,
               r"term 'loss' \(seq_mean.*one sequence \(row \d+ of window A, sequence \d+ of its \d+.*each sequence by "
               r"its own length", PACKED),
    PlantedBug("one_doc_per_row", "documents counted per packed row as 1",
               packed_adapters.one_doc_per_row, Gate.NORMALISER,
               r"term 'loss' \(seq_mean.*additivity.*add up with row_mean's weights", PACKED),
    PlantedBug("pack_token_mean", "a token mean over the window's packed tokens where per-document is declared",
               packed_adapters.pack_token_mean, Gate.NORMALISER,
               r"term 'loss' \(seq_mean.*additivity.*add up with token_mean's weights", PACKED),
    PlantedBug("rank_mask_no_restart", "on rank > 0 the mask ignores the restarts (prime-rl PR #2392, axolotl PR #2495)",
               packed_adapters.rank_mask_no_restart, Gate.DP_EQUIVALENCE,
               r"rank \d: loss of step 0: accumulation error", DDP),
    # -- uneven windows (uneven_adapters.py): ranks with unequal rows and micro-steps ----------------------------
    PlantedBug("equal_rank_weights", "each rank's own mean, averaged equally over ranks (trl PR #6713)",
               uneven_adapters.equal_rank_weights, Gate.DP_EQUIVALENCE,
               r"own mean averaged equally over the 2 ranks \(÷ W\): rank 0: 6 of 10 rows, weight 1/2 where 0\.6 "
               r"\(×0\.833\); rank 1: 4 of 10 rows, weight 1/2 where 0\.4 \(×1\.25\)", UNEVEN),
    PlantedBug("lighter_rank_skips", "a rank with one micro-step never reduces (EasyR1 PR #11012)",
               uneven_adapters.lighter_rank_skips, Gate.BOUNDARY_ONLY,
               r"rank 0 \(2 micro-step\(s\) per window, in \S+uneven_adapters\.py:\d+ \(reduce\)\) hung: waiting in a "
               r"collective .*rank\(s\) 1 \(1 micro-step(?s:.*)rank 0 did not finish; its Python stacks:", UNEVEN_SHORT,
               slow=True, knobs=(("timeout", 10),)),  # a job time-out: ~11 s, CI only
    # -- auxiliary losses (moe_adapters.py): examples/moe_aux.py's global-batch load balancing, declared `batch` --
    PlantedBug("aux_over_world", "the global-batch aux term ÷ W, as if a per-rank mean (Megatron #3672)",
               moe_adapters.aux_over_world, Gate.DP_EQUIVALENCE,
               r"term 'aux' alone: rank \d: loss of step 0 \(×0\.5 = 1/W \(ranks\)\)", MOE_DIST),
    PlantedBug("aux_over_n_twice", "the aux term ÷ N on top of its window normaliser",
               moe_adapters.aux_over_n_twice, Gate.NORMALISER,
               r"term 'aux' \(batch.*vs the big batch .*\(×0\.3333 = 1/N \(micro-steps\)\)", OBJECTIVE),
    PlantedBug("counts_reset_per_micro", "expert counts reset every micro-step: the micro-batch loss (ms-swift #6787)",
               moe_adapters.counts_reset_per_micro, Gate.NORMALISER,
               r"term 'aux' \(batch.*vs the big batch .*is not the big batch's", OBJECTIVE),
    PlantedBug("counts_in_recompute", "expert load tallied again by the checkpoint recompute (NeMo Automodel PR #3247)",
               moe_adapters.counts_in_recompute, Gate.NORMALISER,
               r"term 'aux' \(batch.*vs the big batch .*is not the big batch's", MOE_CKPT),
    # -- issue 42 items 5-6 (windows): a run past 256 micro-steps (broken_numerics.py), a short last window of one
    # process (short_adapters.py: window 1 holds 2 of N = 3 micro-batches, its big batch one step on those 4 rows) --
    PlantedBug("narrow_counter", "a uint8 run-long micro-step counter finds window starts: wraps at 256",
               broken_numerics.narrow_counter, Gate.EQUIVALENCE, r"float64 parameter '[\w.]+' after step 1: ",
               Case(accum_steps=129, micro_batch=1, steps=2, options=TINY, seed=1, data_seed=2)),
    PlantedBug("nominal_n", "a short last window divided by N, not its own count",
               short_adapters.nominal_n, Gate.EQUIVALENCE,
               r"after step 1: .*\(step 1 is the short last window: 2 of N=3 micro-batches",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, last_window=2)),
    PlantedBug("positions_disagree", "token-weighted: micro-steps ÷ N·B·S, the boundary × the positions seen",
               short_adapters.positions_disagree, Gate.EQUIVALENCE,
               r"after step 1: .*\(step 1 is the short last window: 2 of N=3 micro-batches",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, last_window=2,
                    lengths=(4, 1, 0, 3, 2, 4, 4, 0, 1, 3))),
    # -- issue 42 item 3, metrics in every precision (broken_amp_metrics.py): read from the loss-scaled gradient --
    PlantedBug("norm_before_unscale", "grad_norm logged from the fp16 gradient before scaler.unscale_ (×the loss scale)",
               broken_amp_metrics.norm_before_unscale, Gate.REPORTED_METRICS,
               r"the fp16 accumulation run, step 0: grad_norm reported \S+, expected \S+ \(‖the boundary gradient‖, "
               r"every element once\) \(×1024 = the loss scale\)", Case(accum_steps=3, micro_batch=2, steps=2, seed=1,
                                                                         data_seed=2, precision="fp16")),
    PlantedBug("clip_before_unscale", "clip_grad_norm_ before scaler.unscale_: clips by max_norm / the scaled norm",
               broken_amp_metrics.clip_before_unscale, Gate.REPORTED_METRICS,
               r"the fp16 accumulation run, step 0: the clip coefficient applied: .* \(= max_norm over the norm × the "
               r"loss scale\): clipping ran on the loss-scaled gradient, before unscale_",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="fp16")),
    PlantedBug("clip_coef_from_scaled_norm", "clip_coef logged from the norm read before unscale_ (the norm ÷ scale by hand)",
               broken_amp_metrics.clip_coef_from_scaled_norm, Gate.REPORTED_METRICS,
               r"the fp16 accumulation run, step 0: clip_coef reported \S+, expected \S+ .*\(= max_norm over the norm × "
               r"the loss scale\)", Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="fp16")),
    PlantedBug("scaled_under_bf16", "a GradScaler kept on under bf16, grad_norm logged before unscale_",
               broken_amp_metrics.scaled_under_bf16, Gate.REPORTED_METRICS,
               r"the bf16 accumulation run, step 0: grad_norm reported .* \(×1024 = the loss scale\)",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="bf16")),
    # -- issue 42 items 4 and 8 (mesh): padded meshes, a per-rank token count; a reduce-scatter's row on gloo ------
    PlantedBug("cp_rank_token_mean", "each cp rank's own token mean (÷ its count, ≥ 1), averaged over cp: exact on "
               "unpadded rows", cp_adapters.cp_rank_token_mean, Gate.MESH_EQUIVALENCE,
               r"mesh dp=1 pp=1 tp=1 cp=2, chunks=1, outer=3: loss of step 0( \(×[\d.]+\))?: accumulation error", CP_PADDED),
    PlantedBug("dp_replica_token_mean", "each dp replica's own token mean, averaged over dp: exact unless a replica "
               "holds fewer targets", cp_adapters.dp_replica_token_mean, Gate.MESH_EQUIVALENCE,
               r"mesh dp=2 pp=1 tp=1, chunks=1, outer=3: replica \d: loss of step 0( \(×[\d.]+\))?: accumulation "
               r"error", DP_PADDED),
    PlantedBug("zero_eager", "a hand-written ZeRO reduce-scatters every micro-step under its boundary row",
               zero_adapters.zero_eager, Gate.BOUNDARY_ONLY,
               r"micro-step 0 of 3 \(before the boundary\): count table row 'hand-written ZeRO-1' expects none, observed "
               r"(all_reduce|reduce_scatter)×1", DDP),
    # -- issue 42 item 2 (zero_grad_adapters.py): one parameter of a biased-attention LM, whose key bias's gradient is
    # zero in exact arithmetic and judged against the whole gradient (tolerance.param_scale): bugs there still fail
    PlantedBug("bias_grad_times_n", "one bias's gradient (nonzero) × N at the boundary: its 1/N missing",
               zero_grad_adapters.bias_grad_times_n, Gate.EQUIVALENCE,
               r"gradient \(step 0\) of 'q\.bias': accumulation error 2\.000e\+00", OBJECTIVE),
    PlantedBug("zero_grad_made_nonzero", "the key bias (zero in exact arithmetic) given the value bias's gradient",
               zero_grad_adapters.zero_grad_made_nonzero, Gate.EQUIVALENCE,
               r"gradient \(step 0\) of 'k\.bias' \(zero at the run's resolution: relative to the whole gradient\): "
               r"accumulation error", OBJECTIVE),
    # -- issue 42 items 7 and 9 (hints): the bugs whose hint the re-runs must name (tests/harness/test_evidence.py) --
    PlantedBug("accelerate_per_rank_scheduler", "Accelerate's prepared scheduler stepped per rank, undeclared (the "
               "recipe)", _lazy("accelerate_adapters", "fixed_undeclared"), Gate.DP_EQUIVALENCE,
               r"rank 0: (.*(loss|parameter).* after step [12]|(float64|step-[12]))",
               Case(accum_steps=2, micro_batch=2, steps=2, world=2, seed=2, data_seed=3), needs="accelerate"),
    PlantedBug("accelerate_tokens_per_rank_scheduler", "the same on a token-weighted Accelerate LM",
               _lazy("accelerate_adapters", "tokens_undeclared"), Gate.DP_EQUIVALENCE,
               r"rank 0: (.*(loss|parameter).* after step [12]|(float64|step-[12]))",
               Case(accum_steps=2, micro_batch=1, steps=2, world=2, seed=1, data_seed=2,
                    lengths=(3, 0, 5, 2, 4, 5, 1, 5)), needs="accelerate"),
    PlantedBug("per_micro_token_mean", "each micro-batch ÷ its own valid-token count, then ÷ N",
               hint_adapters.per_micro_token_mean, Gate.EQUIVALENCE, r"(loss|gradient) .*step 0",
               Case(accum_steps=3, micro_batch=2, steps=1, seed=1, data_seed=2, lengths=(2, 4, 0, 5, 5, 3))),
    PlantedBug("llama_micro_token_mean", "the Llama recipe, each micro-batch ÷ its own token count, then ÷ N "
               "(its 1.1B size: python -m verify.gpu_gate --scale)", scale_adapters.tiny, Gate.EQUIVALENCE,
               r"(loss|gradient) .*step 0", Case(accum_steps=3, micro_batch=2, steps=1, seed=1, data_seed=2,
                                                 lengths=(16, 2, 16, 16, 3, 16))),
    PlantedBug("llama_chunk_means", "the Llama recipe's chunked loss summing its chunks' means, right within one "
               "chunk (NeMo Automodel #3803's shape): rejected past the declared threshold", scale_adapters.chunk_means,
               Gate.EQUIVALENCE, r"(loss|gradient) .*step 0",
               Case(accum_steps=3, micro_batch=2, steps=1, seed=1, data_seed=2, lengths=(16, 2, 16, 16, 3, 16),
                    options=llama_scale.loss_chunk_side(None, above=True))),
    PlantedBug("ddp_first_bucket_mean", "a DDP comm hook averaging only the first gradient bucket, right while the "
               "model is one bucket: rejected past the recipe's declared bucket cap", bucket_adapters.first_bucket_only,
               Gate.DP_EQUIVALENCE, r"(parameter|gradient)", Case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=1,
                                                      data_seed=2, options=ddp_no_sync.bucket_side(None, above=True))),
    PlantedBug("model_not_in_spec_dtype", "the model built in float32 whatever Spec.dtype (AdamW on a zero-gradient "
               "logit shift)", hint_adapters.wrong_dtype, Gate.EQUIVALENCE, r"'shift'",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)),
    # -- issue 42, the zoo's grads_from="optimizer" classes G, H (optgrads): bugs clipping hides from the post-clip view --
    PlantedBug("step_norm_before_division", "grad_norm logged from the window's Σ before optimizer_step() divides it "
               "(grads_from='optimizer')", atstep_adapters.norm_before_division, Gate.REPORTED_METRICS,
               r"the big batch, step 0: grad_norm reported .*, expected .* \(×36\)",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)),
    PlantedBug("step_norm_of_last_micro", "grad_norm of the last micro-step's own gradient, clipped at the step "
               "(grads_from='optimizer', no max_norm declared)", atstep_adapters.norm_of_last_micro,
               Gate.REPORTED_METRICS, r"the accumulation run, step 0: grad_norm reported .*, the big batch reported",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)),
    PlantedBug("step_micro_count", "the window's Σ ÷ its last micro-batch's count, clipped at the step: ≈ ×N, "
               "which the clip hides from every post-clip view", atstep_adapters.micro_count, Gate.NORMALISER,
               r"additivity over windows .* gradient of '.*': relative error 5\.000e-01",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, options=0.05)),
    PlantedBug("step_grad_all_positions", ".grad ÷ every target position at the step, the loss ÷ the valid ones; "
               "nothing about clipping declared", atstep_adapters.grad_all_positions, Gate.NORMALISER,
               r"additivity over windows .* gradient of '.*': relative error",
               Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, lengths=(3, 5, 2, 4, 5, 1, 4, 5, 3, 2,
                                                                                         5, 4))),
    # -- issue 44 item 3: trainers without a float64 path, judged by the native reference (Numerics(native=...)) --
    PlantedBug("fp8_micro_token_mean", "the torchao FP8 recipe, each micro-batch ÷ its own valid tokens, then ÷ N "
               "(native fp8: the split)", _lazy("native_adapters", "fp8_micro_token_mean"), Gate.EQUIVALENCE,
               r"native fp8: .*step 0.* vs the split", Case(accum_steps=3, micro_batch=2, steps=1, seed=1, data_seed=2,
                                                           lengths=(0, 0, 16, 5, 16, 9)), needs="torchao",
               slow=True),  # importing torchao costs each test worker ~3 s: CI's tier
    PlantedBug("fp8_delayed_per_forward", "FP8 delayed scaling whose amax history advances every forward: micro-step "
               "m quantized at micro-batch m−1's scale", _lazy("native_adapters", "fp8_delayed_per_forward"),
               Gate.EQUIVALENCE, r"native fp8: .*step 0 vs the split", Case(accum_steps=2, micro_batch=2, steps=1,
                                                                            seed=1, data_seed=2)),
    PlantedBug("liger_first_token", "a fused linear cross-entropy whose reduction='none' backward scales every token "
               "by the first one's upstream gradient (Liger < 0.8.2, PR #1298), per-sequence means",
               _lazy("native_adapters", "liger_first_token"), Gate.EQUIVALENCE,
               r"native fp32: gradient \(step 0\) of .* vs the big batch", Case(accum_steps=2, micro_batch=2, steps=1,
                                                                                seed=1, data_seed=2)),
)

BY_NAME = {b.name: b for b in PLANTED}
if len(BY_NAME) != len(PLANTED):
    raise ValueError("planted bugs: two entries share a name")


def of_gate(*gates: Gate | str, module: str | None = None) -> list[PlantedBug]:
    """The planted bugs that the given gates must reject (those of one module of planted/, e.g.
    "broken_dist", when given), by name."""
    return sorted((b for b in PLANTED if b.gate in gates and module in (None, b.module)),
                  key=lambda b: b.name)


def table() -> str:
    """docs/design.md §4's table of planted bugs, drawn from this registry (tests/harness/test_planted.py
    checks that the docs carry it as written here)."""
    rows = ["| planted bug | what it does | trainer | rejected by |", "|---|---|---|---|"]
    rows += [f"| `{b.name}` | {b.what} | `{b.trainer}` | {b.gate} |" for b in PLANTED]
    return "\n".join(rows)
