"""eagle_target: a thin shell over eagle_serve.triton_backend.workers.TargetWorker (one instance, BLS only).
The worker is imported in `initialize`: Triton imports this file first for auto_complete_config
alone (eagle_serve.triton_backend.features)."""
import triton_python_backend_utils as pb_utils

from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.features import TARGET, declare_features


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_config):
        return declare_features(auto_config, *TARGET, __file__)

    def initialize(self, args):
        from eagle_serve.triton_backend.workers import TargetWorker

        self.worker = TargetWorker(args)
        tu.freeze_loaded_objects()

    def execute(self, requests):
        return tu.respond_each(requests, lambda request: self.worker.handle(pb_utils, request))
