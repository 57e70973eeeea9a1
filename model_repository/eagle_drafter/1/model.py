"""eagle_drafter: a thin shell over eagle_serve.triton_backend.workers.DrafterWorker (one instance, BLS only)."""
import triton_python_backend_utils as pb_utils

from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.workers import DrafterWorker


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_config):
        return DrafterWorker.auto_complete_config(auto_config, __file__)

    def initialize(self, args):
        self.worker = DrafterWorker(args)
        tu.freeze_loaded_objects()

    def execute(self, requests):
        return tu.respond_each(requests, lambda request: self.worker.handle(pb_utils, request))
