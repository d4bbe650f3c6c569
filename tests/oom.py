"""Device out-of-memory errors injected into the model's forwards, for the recovery tests."""
import torch


def inject_out_of_memory(monkeypatch, model, failing: dict[str, set[int]]) -> None:
    """Make the `talker`, `predictor` and `vocoder` forwards of `model` raise torch.OutOfMemoryError on
    their calls numbered in `failing` (from 1; in a step the talker runs after the code predictor)
    until `monkeypatch.undo()`."""
    modules = {"talker": model.talker.model, "predictor": model.talker.code_predictor.model,
               "vocoder": model.vocoder}
    calls = dict.fromkeys(modules, 0)

    def inject(name, module):
        forward = module.forward

        def flaky(*args, **kwargs):
            calls[name] += 1
            if calls[name] in failing[name]:
                raise torch.OutOfMemoryError(f"injected: {name} call {calls[name]}")
            return forward(*args, **kwargs)
        monkeypatch.setattr(module, "forward", flaky)
    for name, module in modules.items():
        inject(name, module)
