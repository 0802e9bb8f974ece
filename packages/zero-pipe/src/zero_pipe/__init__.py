"""zero-pipe: pipeline parallelism for the zero training engine."""

from zero_pipe.config import PipelineSectionConfig
from zero_pipe.data import RepeatingLoader
from zero_pipe.engine import ComputeSpan, PipelineConfigError, PipelineEngine
from zero_pipe.initialize import initialize_pipeline
from zero_pipe.instructions import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zero_pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from zero_pipe.schedule import (
    DataParallelSchedule,
    InferenceSchedule,
    InterleavedInferenceSchedule,
    InterleavedTrainSchedule,
    PipeSchedule,
    TrainSchedule,
)
from zero_pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from zero_pipe.version import __version__

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "ComputeSpan",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "InterleavedInferenceSchedule",
    "InterleavedTrainSchedule",
    "LayerSpec",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeDataParallelTopology",
    "PipeInstruction",
    "PipeModelDataParallelTopology",
    "PipeSchedule",
    "PipelineConfigError",
    "PipelineEngine",
    "PipelineModule",
    "PipelineSectionConfig",
    "PipelineParallelGrid",
    "ProcessTopology",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "RepeatingLoader",
    "SendActivation",
    "SendGrad",
    "TiedLayerSpec",
    "TrainSchedule",
    "__version__",
    "initialize_pipeline",
]
