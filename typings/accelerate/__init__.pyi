# Type stubs for the part of Accelerate (1.15) that hf_altparams uses. Accelerate ships no `py.typed`, so
# without these every Accelerate name is `Any` to mypy and the integration (PhasedAccelerator subclasses
# Accelerator, PhasedOptimizer subclasses AcceleratedOptimizer) would go unchecked. Only the names and
# members the package uses are here, typed from Accelerate's source; setup.cfg points mypy at this folder
# (`mypy_path`). Not shipped: the wheel holds hf_altparams only. tests/integrations/test_accelerate_stubs.py checks
# that every name here exists in the installed Accelerate, with the parameter names written here.
# A new use of an Accelerate name: add it here (mypy names what is missing).

from .accelerator import Accelerator as Accelerator
from .state import PartialState as PartialState

__version__: str
