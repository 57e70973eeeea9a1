"""The engine's state: requests and their sampling, logits processors and grammars, stop
strings, the scheduler, KV pages and the prefix cache, the draft-slot workspace."""
