"""Workers: a model's flat parameters, a ``ParamSync`` (the PS in sync, async, SSP or dense-sync
mode; peer mode in ``worker.peer``), and the trainer's step pipeline."""
from worker.binding import PSEmbedding
from worker.flat import FlatParams
from worker.paramsync import ParamSync, PSSync
from worker.tasks import Task, load_task
from worker.trainer import MODES, PEER_MODES, Summary, TrainConfig, Trainer

__all__ = [
    "PSEmbedding", "FlatParams", "ParamSync", "PSSync", "Task", "load_task", "TrainConfig", "Trainer", "Summary",
    "MODES", "PEER_MODES",
]
