"""What the `eagle_target` and `eagle_drafter` Triton models do with a BLS request.

Each worker loads its model once (settings from spec_decode's config.pbtxt, device from the
instance kind), then turns request tensors into a forward / propose call and back. An epoch
drawn at start-up goes out with every response so spec_decode can tell a restarted process.
"""
from __future__ import annotations

import json
import random

import torch

from eagle_serve import triton_utils as tu
from eagle_serve.bls import batch_from_request, input_tensor, optional_pair, response_tensors
from eagle_serve.settings import read_settings


def instance_device(args: dict) -> torch.device:
    if args.get("model_instance_kind") == "GPU":
        return torch.device("cuda", int(args.get("model_instance_device_id", 0)))
    return torch.device("cpu")


class _Worker:
    role = ""

    def __init__(self, args: dict):
        tu.require_single_instance(json.loads(args["model_config"]))
        self.repo = tu.repository_dir(args)
        self.settings = read_settings(self.repo)
        self.device = instance_device(args)
        self.dtype = self.settings.torch_dtype(self.device.type == "cuda")
        self.target_dir, self.drafter_dir = self.settings.model_dirs(self.repo)
        self.epoch = random.getrandbits(62)
        if self.device.type == "cpu":
            self.settings.apply_threads(self.role)


class TargetWorker(_Worker):
    role = "target"
    def __init__(self, args: dict):
        super().__init__(args)
        from eagle_serve.checkpoints import load_head
        from eagle_serve.target import TargetModel

        layers = None
        if self.drafter_dir is not None:
            layers = load_head(self.drafter_dir, self.target_dir).spec.feature_layers
        s = self.settings
        self.model = TargetModel(self.target_dir, dtype=self.dtype, device=self.device,
                                 num_pages=s.num_target_pages, page_size=s.page_size,
                                 feature_layers=layers)

    def handle(self, pb, request) -> list:
        batch, sampling = batch_from_request(pb, request, self.device)
        rows = input_tensor(pb, request, "logit_rows").to(self.device)
        moves = optional_pair(pb, request, ("kv_move_src", "kv_move_dst"), self.device)
        out = self.model.forward(batch, rows, sampling, kv_moves=moves)
        return response_tensors(pb, {"hidden": out.hidden.float(), "argmax": out.argmax,
                                     "probs": out.probs.float()}, self.epoch)


class DrafterWorker(_Worker):
    role = "drafter"
    def __init__(self, args: dict):
        super().__init__(args)
        from eagle_serve.checkpoints import load_drafter

        self.drafter = None
        if self.drafter_dir is not None:
            s = self.settings
            self.drafter = load_drafter(self.drafter_dir, self.target_dir, dtype=self.dtype,
                                        device=self.device, num_pages=s.num_drafter_pages,
                                        page_size=s.page_size, pruning=s.draft_pruning())

    def handle(self, pb, request) -> list:
        if self.drafter is None:
            raise tu.RequestError("no drafter is configured (drafter_model is none)")
        batch, sampling = batch_from_request(pb, request, self.device)
        features = input_tensor(pb, request, "features").to(self.device)
        num_drafts = input_tensor(pb, request, "num_drafts").to(self.device)
        shape = optional_pair(pb, request, ("draft_topk", "draft_depth"), self.device)
        topk, depth = shape if shape is not None else (None, None)
        out = self.drafter.propose(batch, features, num_drafts, sampling, topk=topk, depth=depth)
        named = {"tokens": out.tokens, "probs": out.probs.float()}
        if topk is not None:
            named["parents"] = out.parents
        return response_tensors(pb, named, self.epoch)
