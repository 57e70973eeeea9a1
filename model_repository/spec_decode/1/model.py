"""spec_decode: decoupled; hands each request to the engine thread (eagle_serve.triton_backend.service).
The service is imported in `initialize`: Triton imports this file first for auto_complete_config
alone (eagle_serve.triton_backend.features)."""
import triton_python_backend_utils as pb_utils

from eagle_serve.triton_backend import internal_key
from eagle_serve.triton_backend import io as tu


class TritonPythonModel:
    def initialize(self, args):
        from eagle_serve.triton_backend.service import start_service

        self.service = start_service(pb_utils, args)
        tu.freeze_loaded_objects()

    def execute(self, requests):
        for request in requests:
            self.service.submit(request)
        return None

    def finalize(self):
        self.service.shutdown()
        internal_key.forget_server_key()
