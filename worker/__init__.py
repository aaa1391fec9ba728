"""Workers: bind a torch model to the PS and train it in sync, async, SSP or hybrid mode."""
from worker.binding import ModelBinding, PSEmbedding
from worker.tasks import Task, load_task
from worker.trainer import MODES, Summary, TrainConfig, Trainer

__all__ = ["PSEmbedding", "ModelBinding", "Task", "load_task", "TrainConfig", "Trainer", "Summary", "MODES"]
