"""eagle_drafter: a thin shell over eagle_serve.triton_backend.workers.DrafterWorker (one instance, BLS only).
The worker is imported in `initialize`: Triton imports this file first for auto_complete_config
alone (eagle_serve.triton_backend.features)."""
import triton_python_backend_utils as pb_utils

from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.features import DRAFTER, declare_features


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_config):
        return declare_features(auto_config, *DRAFTER, __file__)

    def initialize(self, args):
        from eagle_serve.triton_backend.workers import DrafterWorker

        self.worker = DrafterWorker(args)
        tu.freeze_loaded_objects()

    def execute(self, requests):
        return tu.respond_each(requests, lambda request: self.worker.handle(pb_utils, request))
