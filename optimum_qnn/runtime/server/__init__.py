"""The OpenAI-compatible server (`python -m optimum_qnn serve`): `app.build_app`, `engine.Engine`, `protocol`."""
