"""spec_decode: decoupled; hands each request to the engine thread (eagle_serve.triton_backend.service)."""
import json

import triton_python_backend_utils as pb_utils
from transformers import AutoConfig

from eagle_serve.core.tokenization import eos_token_ids, load_tokenizer
from eagle_serve.engine import Engine
from eagle_serve.kernels.warmup import warm_engine
from eagle_serve.models.checkpoints import settings_dtype
from eagle_serve.settings import EngineConfig, ServingSettings, generation_defaults
from eagle_serve.spec.lookup import load_corpus_index
from eagle_serve.triton_backend import internal_key
from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.bls import BlsDrafter, BlsTarget
from eagle_serve.triton_backend.metrics import EngineMetrics
from eagle_serve.triton_backend.service import SpecDecodeService
from eagle_serve.triton_backend.workers import instance_device, log_warmup


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        tu.require_single_instance(config)
        settings = ServingSettings.from_parameters(tu.model_parameters(config))
        target_dir, drafter_dir = settings.model_dirs(tu.repository_dir(args))
        device = instance_device(args)
        dtype = settings_dtype(settings, device.type == "cuda", tu.repository_dir(args))
        settings = settings.resolved(target_dir, dtype.itemsize)  # as eagle_target's
        print(f"spec_decode: {settings.kv_summary()}", flush=True)
        if device.type == "cpu":
            settings.apply_threads("engine")
        vocab = AutoConfig.from_pretrained(str(target_dir)).vocab_size
        bls = dict(key=internal_key.server_key(), timeout_s=settings.model_call_timeout_s)
        target = BlsTarget(pb_utils, vocab, device, **bls)
        drafter = BlsDrafter(pb_utils, vocab, device, **bls) if drafter_dir is not None else None
        tokenizer = load_tokenizer(target_dir)
        corpus = settings.corpus_index_path(tu.repository_dir(args), drafter_dir)
        engine = Engine(target, drafter, EngineConfig.from_settings(settings, eos_token_ids(target_dir)),
                        tokenizer=tokenizer, device=device,
                        corpus=load_corpus_index(corpus, tokenizer) if corpus else None)
        log_warmup("spec_decode", warm_engine(engine))  # GPU kernels compiled before any request
        metrics = EngineMetrics(pb_utils, settings.max_speculative_tokens, model_name=target_dir.name)
        self.service = SpecDecodeService(pb_utils, engine, metrics, settings.max_input_bytes,
                                         draft_timeout_s=settings.model_call_timeout_s,
                                         on_broken=tu.stop_server,
                                         apply_chat_template=settings.apply_chat_template,
                                         defaults=generation_defaults(target_dir))
        tu.freeze_loaded_objects()

    def execute(self, requests):
        for request in requests:
            self.service.submit(request)
        return None

    def finalize(self):
        self.service.shutdown()
        internal_key.forget_server_key()
