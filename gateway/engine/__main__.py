"""`python -m gateway.engine --port N --ctx 2048`: serve SmolLM2 with llama.cpp until SIGTERM/SIGINT."""

from gateway.engine.serve import main

raise SystemExit(main())
