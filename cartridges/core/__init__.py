"""The engine's core: cartridge rows and how they enter a frozen model.

It owns loading and fingerprinting the host model (`models`, `packaged`), the rows
themselves (`cartridge`, with KV-compression inits in `compress`), the one place rows
enter attention (`prefix`, `attention`), cartridge files (`files`), the distillation
loss and training steps (`loss`, `targets`, `train`, `health`), chat templates (`chat`),
corpus reading (`corpus`) and batched generation behind rows (`generate`, `batch`,
`sharing`, `drafts`). Nothing here knows about self-study, evaluation or fleets.
"""
