"""The stand-in backend's driver: never active, so Triton never selects it."""

from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the engram test model's 'cpu' Triton driver launches nothing")

    def get_current_target(self):
        raise NotImplementedError("the engram test model's 'cpu' Triton driver launches nothing")

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("the engram test model's 'cpu' Triton driver benchmarks nothing")
