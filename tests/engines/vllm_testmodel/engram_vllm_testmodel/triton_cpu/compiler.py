"""The stand-in backend's compiler: it compiles nothing (kernels run under TRITON_INTERPRET=1)."""

from triton.backends.compiler import BaseBackend


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target) -> bool:
        return False

    def hash(self) -> str:
        return "engram-testmodel-interpreter-only"

    def parse_options(self, options: dict) -> object:
        raise NotImplementedError("the engram test model's 'cpu' Triton backend compiles nothing: "
                                  "run with TRITON_INTERPRET=1")

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise NotImplementedError("the engram test model's 'cpu' Triton backend compiles nothing")

    def load_dialects(self, context) -> None:
        pass

    def get_module_map(self) -> dict:
        return {}
