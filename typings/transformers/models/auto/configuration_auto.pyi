import os
from typing import Any

class AutoConfig:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], **kwargs: Any) -> Any: ...
