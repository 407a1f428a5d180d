"""A vLLM-compatible engine emulator for demos, tests and benchmarks.

``async with run_emulator(EmulatorConfig(max_num_seqs=8)) as emu:`` serves it on 127.0.0.1 in the
running event loop; ``emu.base_url`` is where to send requests and ``emu.engine`` exposes the
engine's state (``statistics()``, ``received``, ``finished``) and its ``faults`` switches.
"""

from .app import Emulator, create_app
from .engine import (
    EmulatedEngine,
    EmulatorConfig,
    EngineStatistics,
    FaultSwitches,
    ReceivedRequest,
)
from .server import (
    EmulatorProcess,
    RunningEmulator,
    add_emulate_parser,
    run_emulator,
    run_emulator_subprocess,
)

__all__ = [
    "EmulatedEngine",
    "Emulator",
    "EmulatorConfig",
    "EmulatorProcess",
    "EngineStatistics",
    "FaultSwitches",
    "ReceivedRequest",
    "RunningEmulator",
    "add_emulate_parser",
    "create_app",
    "run_emulator",
    "run_emulator_subprocess",
]
