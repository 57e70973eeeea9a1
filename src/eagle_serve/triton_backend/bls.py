"""The engine's runners over Triton BLS, and the tensor conventions of those calls.

`BlsTarget` / `BlsDrafter` implement `TargetRunner` / `DrafterRunner` by calling the
`eagle_target` / `eagle_drafter` models; `batch_from_request` etc. are what those models use to
read the same tensors back. Tensors cross processes through DLPack (GPU tensors stay on the GPU
on KIND_GPU instances). Each model reports an epoch (random per process start): a changed
epoch means the model's KV tensors are gone, and the engine recomputes (`KVLost`).

Every call carries the server's internal key (`eagle_serve.triton_backend.internal_key`): the workers answer
nobody else. A call that does not return within `timeout_s`, or that Triton answers with its
"not healthy" error (the model process died), raises `ModelUnavailable`: the engine cannot go
on. Any other error response raises `ModelCallError` (the engine retries the batch's requests
one at a time).

Only `triton_python_backend_utils` (passed in as `pb`) ties this to Triton.
"""
from __future__ import annotations

import concurrent.futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from eagle_serve.core.interfaces import (
    DraftOutput,
    DraftShapes,
    KVLost,
    ModelUnavailable,
    RaggedBatch,
    RowSampling,
    TargetOutput,
)
from eagle_serve.core.processors import LogitsProcessors
from eagle_serve.triton_backend import internal_key

BATCH_FIELDS = ("input_ids", "positions", "cu_seqlens", "seq_lens", "block_tables", "slot_mapping")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds")
SHAPE_INPUTS = {"num_drafts": "num_drafts", "draft_topk": "topk", "draft_depth": "depth",
                "draft_min_prob": "min_prob", "draft_expand_prob": "expand_prob"}  # input -> field
# Optional inputs, sent only when present (a batch with a draft tree; KV moves; logits
# processors): tree_mask [B, Qt, Qt] INT8; kv_move_src / kv_move_dst [M] INT64; the fields of
# LogitsProcessors, each prefixed "proc_" (all sent together); draft_coupled [B] INT8
# (DraftShapes.coupled). The target's optional output: logprobs [L, V] FP32.
PROCESSOR_INPUTS = tuple("proc_" + name for name in LogitsProcessors.names())


def to_pb(pb, name: str, tensor: torch.Tensor):
    # the tensor itself, not a DLPack capsule: Triton then asks it for its data on its own
    # stream (__dlpack__(stream=...)), so a GPU tensor's pending writes are ordered before use
    return pb.Tensor.from_dlpack(name, tensor.contiguous())


def input_tensor(pb, request, name: str, optional: bool = False) -> torch.Tensor | None:
    """A request's input as a torch tensor, zero-copy (None if optional and absent)."""
    tensor = pb.get_input_tensor_by_name(request, name)
    if tensor is None:
        if optional:
            return None
        raise ValueError(f"input '{name}' is missing")
    return torch.from_dlpack(tensor)


def output_tensor(pb, response, name: str) -> torch.Tensor | None:
    """A BLS response's output as a torch tensor (None if absent), zero-copy."""
    tensor = pb.get_output_tensor_by_name(response, name)
    return None if tensor is None else torch.from_dlpack(tensor)


def batch_tensors(pb, batch: RaggedBatch, sampling: RowSampling) -> list:
    tree = [] if batch.tree_mask is None else [to_pb(pb, "tree_mask", batch.tree_mask.to(torch.int8))]
    return ([to_pb(pb, f, getattr(batch, f)) for f in BATCH_FIELDS] + tree
            + [to_pb(pb, f, getattr(sampling, f)) for f in SAMPLING_FIELDS])


def batch_from_request(pb, request, device) -> tuple[RaggedBatch, RowSampling]:
    """The batch and its sampling rows; the longest request's new tokens are read once here
    (one host sync per call, not one per attention layer)."""
    read = lambda name: input_tensor(pb, request, name).to(device)  # noqa: E731
    tree = input_tensor(pb, request, "tree_mask", optional=True)
    batch = RaggedBatch(*(read(f) for f in BATCH_FIELDS),
                        tree_mask=None if tree is None else tree.to(device).bool())
    cu = batch.cu_seqlens
    batch.max_query_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return batch, RowSampling(*(read(f) for f in SAMPLING_FIELDS))


def shapes_from_request(pb, request, device) -> DraftShapes:
    coupled = input_tensor(pb, request, "draft_coupled", optional=True)
    return DraftShapes(**{field: input_tensor(pb, request, name).to(device)
                          for name, field in SHAPE_INPUTS.items()},
                       coupled=None if coupled is None else coupled.to(device).bool())


def processors_from_request(pb, request, device) -> LogitsProcessors | None:
    """None when no proc_ input came; an absent one is empty (only non-empty ones are sent)."""
    tensors = {name: input_tensor(pb, request, name, optional=True) for name in PROCESSOR_INPUTS}
    if all(t is None for t in tensors.values()):
        return None
    return LogitsProcessors.staged({
        name: (torch.zeros(0, dtype=LogitsProcessors.dtype(name[5:]), device=device) if t is None
               else t.to(device)) for name, t in tensors.items()})


def optional_pair(pb, request, names: tuple[str, str], device) -> tuple | None:
    """Two optional inputs sent together -> (a, b) on `device`, or None when absent."""
    a, b = (input_tensor(pb, request, n, optional=True) for n in names)
    return None if a is None or b is None else (a.to(device), b.to(device))


class ModelCallError(RuntimeError):
    """The model answered a call with an error."""


class _BlsModel:
    MODEL_NAME = ""

    def __init__(self, pb, vocab_size: int, device="cpu", *, key: str, timeout_s: float = 0.0):
        """vocab_size: the target's."""
        self.pb, self.model_name, self.device = pb, self.MODEL_NAME, torch.device(device)
        self.vocab_size, self.key, self.timeout_s = vocab_size, key, timeout_s
        self.epoch: int | None = None
        self._caller = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"bls-{self.MODEL_NAME}")

    def call(self, inputs: list, outputs: list[str]) -> dict[str, torch.Tensor]:
        pb = self.pb
        kwargs = {}
        if self.device.type == "cuda":
            kwargs["preferred_memory"] = pb.PreferredMemory(pb.TRITONSERVER_MEMORY_GPU, self.device.index or 0)
        key = pb.Tensor(internal_key.INPUT_NAME, np.array([self.key.encode()], dtype=np.object_))
        request = pb.InferenceRequest(model_name=self.model_name, inputs=inputs + [key],
                                      requested_output_names=outputs + ["epoch"], **kwargs)
        response = self._exec(request)
        if response.has_error():
            message = f"{self.model_name}: {response.error().message()}"
            if "is not healthy" in message:  # Triton's word for a dead model process
                raise ModelUnavailable(message)
            raise ModelCallError(message)
        result = {name: output_tensor(pb, response, name) for name in outputs + ["epoch"]}
        epoch = int(result.pop("epoch")[0])
        if self.epoch is not None and epoch != self.epoch:
            self.epoch = epoch
            raise KVLost(f"{self.model_name} restarted: its KV cache is gone")
        self.epoch = epoch
        return {k: v.to(self.device) for k, v in result.items() if v is not None}

    def _exec(self, request):
        if not self.timeout_s:
            return request.exec()
        future = self._caller.submit(request.exec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ModelUnavailable(f"{self.model_name} did not answer within {self.timeout_s:g} s "
                               f"(model_call_timeout_s)") from None


class BlsTarget(_BlsModel):
    MODEL_NAME = "eagle_target"

    def forward(self, batch: RaggedBatch, logit_rows: torch.Tensor, sampling: RowSampling,
                kv_moves: tuple[torch.Tensor, torch.Tensor] | None = None,
                processors: LogitsProcessors | None = None) -> TargetOutput:
        outputs = ["hidden", "argmax"] + (["probs"] if sampling.sampled_indices().numel() else [])
        if processors is not None and processors.logprob_rows.numel():
            outputs.append("logprobs")
        inputs = batch_tensors(self.pb, batch, sampling) + [to_pb(self.pb, "logit_rows", logit_rows)]
        if kv_moves is not None and kv_moves[0].numel() > 0:
            inputs += [to_pb(self.pb, "kv_move_src", kv_moves[0]),
                       to_pb(self.pb, "kv_move_dst", kv_moves[1])]
        if processors is not None:
            inputs += [to_pb(self.pb, "proc_" + name, t) for name, t in processors.tensors().items()
                       if t.numel()]
        r = self.call(inputs, outputs)
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)  # no rows needed logits
        probs = r.get("probs", torch.zeros((0, self.vocab_size), device=self.device))
        return TargetOutput(hidden=r["hidden"], argmax=r.get("argmax", empty), probs=probs,
                            logprobs=r.get("logprobs"))


class BlsDrafter(_BlsModel):
    MODEL_NAME = "eagle_drafter"

    def propose(self, batch: RaggedBatch, features: torch.Tensor, shapes: DraftShapes,
                sampling: RowSampling) -> DraftOutput:
        coupled = shapes.coupled_rows()
        wants_probs, trees, any_coupled = torch.stack([  # one read
            (sampling.sampled & ~coupled & (shapes.num_drafts > 0)).any(), (shapes.topk > 1).any(),
            coupled.any()]).tolist()
        outputs = ["tokens"] + (["probs"] if wants_probs else []) + (["parents"] if trees else [])
        inputs = batch_tensors(self.pb, batch, sampling) + [to_pb(self.pb, "features", features)]
        inputs += [to_pb(self.pb, name, getattr(shapes, field)) for name, field in SHAPE_INPUTS.items()]
        if any_coupled:
            inputs.append(to_pb(self.pb, "draft_coupled", coupled.to(torch.int8)))
        r = self.call(inputs, outputs)
        no_drafts = torch.zeros((shapes.num_drafts.shape[0], 0), dtype=torch.int64, device=self.device)
        probs = r.get("probs", torch.zeros((0, self.vocab_size), device=self.device))
        return DraftOutput(tokens=r.get("tokens", no_drafts), probs=probs, parents=r.get("parents"))


def response_tensors(pb, named: dict[str, torch.Tensor], epoch: int) -> list:
    """Outputs of a model call; empty tensors are left out (requested only when non-empty)."""
    tensors = [to_pb(pb, name, t) for name, t in named.items() if t.numel() > 0]
    return tensors + [to_pb(pb, "epoch", torch.tensor([epoch], dtype=torch.int64))]
