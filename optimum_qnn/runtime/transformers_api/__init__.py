"""The transformers face of the runtime's models: `generate` with transformers' semantics (`generate`), the options
it resolves and refuses (`options`), how a row's tokens are chosen (`choosing`), and the attributes and methods that
``pipeline()`` and user code read (`model_api`). Works without transformers (numpy in, numpy out)."""
