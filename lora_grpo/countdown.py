"""`lora_grpo.countdown` is `lora_grpo.tasks.countdown`: kept so that recipes naming
`lora_grpo.countdown:...` still work."""

import sys

from .tasks import countdown as _module

sys.modules[__name__] = _module  # one module object: patching either name patches both
