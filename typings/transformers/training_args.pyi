from typing import Any

class TrainingArguments:
    output_dir: str | None
    @property
    def should_save(self) -> Any: ...
