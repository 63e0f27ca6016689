"""`lora_grpo.toy` is `lora_grpo.tasks.toy`: kept so that recipes naming `lora_grpo.toy:...` still work."""

import sys

from .tasks import toy as _module

sys.modules[__name__] = _module  # one module object: patching either name patches both
