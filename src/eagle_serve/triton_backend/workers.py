"""What the `eagle_target` and `eagle_drafter` Triton models do with a BLS request.

Each worker loads its model once (settings from spec_decode's config.pbtxt, device from the
instance kind), then turns request tensors into a forward / propose call and back. An epoch
drawn at start-up goes out with every response so spec_decode can tell a restarted process.
A request without the server's internal key is refused before any tensor is read: only
spec_decode may call the workers (see eagle_serve.triton_backend.internal_key).

The features (the target's hidden states that feed the head) cross BLS in the model dtype, with
no conversion on either side. That dtype is chosen at start-up (`dtype: auto` picks bfloat16 on a
GPU or a CPU that computes it natively, else float32), so the two configs leave the tensor out and
each model's `auto_complete_config` declares it (`declare_features`), from the same settings:
the target's output `hidden` and the drafter's input `features` always agree
(eagle_serve.triton_backend.features).

Test hook: a worker whose config has the parameter `test_hang_file` stalls every call while that
file exists (the tests' way to make a model process hang).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from eagle_serve.kernels.warmup import warm_drafter, warm_target
from eagle_serve.models.dtypes import settings_dtype
from eagle_serve.settings import read_settings, settings_file
from eagle_serve.triton_backend import client_request as cr
from eagle_serve.triton_backend import internal_key
from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.bls import (
    batch_from_request,
    input_tensor,
    optional_pair,
    processors_from_request,
    response_tensors,
    shapes_from_request,
)
from eagle_serve.triton_backend.features import DRAFTER, TARGET, require_features


def log_warmup(role: str, report) -> None:
    """One log line after a GPU instance compiled its kernel variants (report None: on CPU)."""
    if report is not None:
        print(f"{role}: kernels compiled for every launch shape ({report.launches} launches, "
              f"{report.seconds:.1f} s)", flush=True)


def instance_device(args: dict) -> torch.device:
    if args.get("model_instance_kind") == "GPU":
        return torch.device("cuda", int(args.get("model_instance_device_id", 0)))
    return torch.device("cpu")


class _Worker:
    role = ""
    features: tuple[str, str] = ("", "")  # (direction, name) of the features tensor

    def __init__(self, args: dict):
        config = json.loads(args["model_config"])
        tu.require_single_instance(config)
        self.name = config.get("name", self.role)
        self.key = internal_key.server_key()
        hang = tu.model_parameters(config).get("test_hang_file")
        self.hang_file = Path(hang) if hang else None
        self.repo = tu.repository_dir(args)
        self.settings = read_settings(self.repo)
        print(f"eagle_{self.role}: settings from {settings_file(self.repo)}", flush=True)
        self.device = instance_device(args)
        self.dtype = settings_dtype(self.settings, self.device.type == "cuda", self.repo)
        require_features(config, *self.features, self.dtype)
        self.target_dir, self.drafter_dir = self.settings.model_dirs(self.repo)
        self.settings = self.settings.resolved(self.target_dir, self.dtype.itemsize)
        self.epoch = random.getrandbits(62)
        if self.device.type == "cpu":
            self.settings.apply_threads(self.role)

    def check_caller(self, pb, request) -> None:
        """Refuse a request that does not carry the internal key (anyone but spec_decode)."""
        sent = pb.get_input_tensor_by_name(request, internal_key.INPUT_NAME)
        value = None if sent is None else sent.as_numpy().reshape(-1)[:1]
        if value is None or value.size != 1 or not internal_key.is_valid(value[0], self.key):
            raise cr.RequestError(f"{self.name} is internal: only spec_decode may call it; send "
                                  f"requests to the ensemble or to spec_decode")
        while self.hang_file is not None and self.hang_file.exists():
            time.sleep(0.1)


class TargetWorker(_Worker):
    role = "target"
    features = TARGET

    def __init__(self, args: dict):
        super().__init__(args)
        from eagle_serve.models.checkpoints import load_head
        from eagle_serve.models.target import TargetModel

        layers = None
        if self.drafter_dir is not None:
            layers = load_head(self.drafter_dir, self.target_dir).spec.feature_layers
        s = self.settings
        self.model = TargetModel(self.target_dir, dtype=self.dtype, device=self.device,
                                 num_pages=s.cache.num_target_pages, page_size=s.cache.page_size,
                                 feature_layers=layers, activations=s.model.target_activations,
                                 cuda_graphs=s.model.cuda_graphs)
        log_warmup("eagle_target", warm_target(self.model))  # not at the first request

    def handle(self, pb, request) -> list:
        self.check_caller(pb, request)
        batch, sampling = batch_from_request(pb, request, self.device)
        rows = input_tensor(pb, request, "logit_rows").to(self.device)
        moves = optional_pair(pb, request, ("kv_move_src", "kv_move_dst"), self.device)
        out = self.model.forward(batch, rows, sampling, kv_moves=moves,
                                 processors=processors_from_request(pb, request, self.device))
        named = {"hidden": out.hidden, "argmax": out.argmax, "probs": out.probs.float()}
        if out.logprobs is not None:
            named["logprobs"] = out.logprobs.float()
        return response_tensors(pb, named, self.epoch)


class DrafterWorker(_Worker):
    role = "drafter"
    features = DRAFTER

    def __init__(self, args: dict):
        super().__init__(args)
        from eagle_serve.models.checkpoints import load_drafter

        self.drafter = None
        if self.drafter_dir is not None:
            s = self.settings
            self.drafter = load_drafter(self.drafter_dir, self.target_dir, dtype=self.dtype,
                                        device=self.device, num_pages=s.cache.num_drafter_pages,
                                        page_size=s.cache.page_size, weights=s.model.drafter_weights)
            log_warmup("eagle_drafter", warm_drafter(self.drafter))

    def handle(self, pb, request) -> list:
        self.check_caller(pb, request)
        if self.drafter is None:
            raise cr.RequestError("no drafter is configured (drafter_model is none)")
        batch, sampling = batch_from_request(pb, request, self.device)
        features = input_tensor(pb, request, "features").to(self.device)
        shapes = shapes_from_request(pb, request, self.device)
        out = self.drafter.propose(batch, features, shapes, sampling)
        named = {"tokens": out.tokens, "probs": out.probs.float()}
        if out.parents is not None:
            named["parents"] = out.parents
        return response_tensors(pb, named, self.epoch)
