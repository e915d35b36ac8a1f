"""The project's exception types, in one place, by the part that raises them; every module, test and
plug-in imports them from here (environments may also take theirs from ``envs.base``).

A user's mistake (a flag, a file, a row, a plug-in) is a ConfigError, DatasetError, PluginError,
TrainSetupError, LaunchError, DumpError, ... whose message names the flag, file, row or key; the CLI
prints it as one line. The environment API's errors (RetryableEnvError, RecoverableEnvError,
InvalidActionError) are what environments raise to the rollout (``slime_mt/environment.py``).
"""

from __future__ import annotations

# ---------------------------------------------------------------- configuration and inputs


class ConfigError(ValueError):
    """A flag, YAML key or value that cannot be used; the message names it."""


class RunDirError(ConfigError):
    """The run folder is another run's (in use now, or holding an earlier run not resumed)."""


class PluginError(ImportError):
    """A plug-in path that cannot be loaded or does not fit; the message says what to fix."""


class DatasetError(ValueError):
    """A data file or row that cannot be used; names the file and the row."""


class SampleError(ValueError):
    """A Sample whose fields break an invariant; the message names the field and the lengths."""


class ProcessorError(ValueError):
    """Text and images that do not fit together; the message gives both counts."""


class EncodingError(ValueError):
    """A chat template that the delta trick cannot use; the message says what was rendered."""


class AssetError(RuntimeError):
    """An offline asset that cannot be found or built; the message says what to install."""


class TrainSetupError(RuntimeError):
    """Something the run needs is missing or broken; raised before anything is written."""


# ---------------------------------------------------------------- environments (the API of slime_mt/environment.py)


class RetryableEnvError(RuntimeError):
    """A transient environment fault (tool server busy, sandbox restart): retry the same step."""


class RecoverableEnvError(RuntimeError):
    """The env lost its state (its sandbox, server or simulator restarted): reset it and replay."""


class InvalidActionError(ValueError):
    """The model's output could not be acted on; ``feedback`` (text, or an observation dict) tells it why."""

    def __init__(self, feedback: str | dict):
        super().__init__(feedback if isinstance(feedback, str) else feedback.get("text", ""))
        self.observation = {"text": feedback} if isinstance(feedback, str) else dict(feedback)


# ---------------------------------------------------------------- engines and their clients


class HTTPError(Exception):
    """A request that got no complete answer."""


class ConnectError(HTTPError):
    """The connection could not be opened (refused, unreachable, or not within the connect timeout)."""


class ConnectionLost(HTTPError):
    """The connection closed or broke before the whole answer came."""

    before_answer = True  # no byte of the answer had come (set where the connection fails)


class EngineError(RuntimeError):
    """An engine that could not answer within the retry budget; names the URL and the last failure."""


class EngineRequestError(EngineError):
    """The engine rejected the request (HTTP 4xx): the request is wrong, retrying cannot help."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message


class EngineTimeoutError(EngineError):
    """A request that took longer than its timeout (a generate is aborted on the engine)."""


class ProtocolError(ValueError):
    """A malformed request; the server answers with ``status`` (HTTP 400 unless set) and this message."""

    status = 400


class PayloadTooLarge(ProtocolError):
    status = 413


class PayloadError(ValueError):
    """A payload that is not SGLang's named-tensor format, or names a callable other than torch's rebuilders."""


class WeightUpdateError(ValueError):
    """A weight update that was refused before anything changed; names the tensor, file or folder."""


class LaunchError(RuntimeError):
    """An engine or router that could not be started; names the command and its log file."""


class EngineFault(RuntimeError):
    """The engine failed while serving a request (not the client's fault): HTTP 500 naming the cause."""


class EngineAsleep(RuntimeError):
    """A request while the engine's memory is released (or its weights not yet reloaded): HTTP 503."""


class MemoryBusy(RuntimeError):
    """A memory release while requests are in the engine: HTTP 400, as SGLang refuses it."""


# ---------------------------------------------------------------- the rollout


class ContextPolicyError(ValueError):
    """A ``--context-policy`` spec or policy result that cannot be used; the message names it."""


class RewardError(ValueError):
    """A reward that cannot be computed as configured; names the flag or the row's key."""


class StepWiseError(ValueError):
    """Step-wise samples that break an invariant; the message names the sample and the rule."""


class RolloutError(RuntimeError):
    """A rollout that cannot produce the requested data; names the flag to look at."""


class RolloutFailedError(RuntimeError):
    """Every sample of a step failed (``--max-failed-steps`` times): nothing to train on."""


class RolloutRoleFailed(RuntimeError):
    """The rollout role raised while making a step's batch (a rollout function's bug, a lost engine):
    the message names the role and the step; every trainer rank stops with it."""


class EngineAbortedTurn(EngineError):
    """The engine aborted one turn more often than ``--engine-max-retries`` allows, and no weight
    update caused it: the sample fails (an aborted trajectory is never trained as the model's own end)."""


class EnvStepFailed(RuntimeError):
    """The env failed past its retry or reset budget (or with an error no retry helps); ``cause``
    groups like failures in the step's report."""

    def __init__(self, message: str, retries: int, cause: str):
        super().__init__(message)
        self.retries = retries
        self.cause = cause


class EpisodeRestart(Exception):
    """The environment was reset and cannot be brought back to the episode's state: the episode
    starts again from its prompt (the turns generated so far are dropped, never trained)."""


class EpisodeLost(RetryableEnvError):
    """The worker holds no environment for the episode: it was restarted since the episode was built."""


class EnvReplayDiverged(RuntimeError):
    """Replaying an episode on a restarted worker gave another observation than the model saw."""


class RolloutProcessLost(RuntimeError):
    """A group's rollout process died under it on every attempt."""


class GatewayError(Exception):
    """A request the gateway refuses: HTTP ``status`` with a message that names the field."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


# ---------------------------------------------------------------- training and its runs


class ModelConfigError(ValueError):
    """A checkpoint this backend cannot build; names the folder and the field."""


class RopeConfigError(ValueError):
    """A rope configuration the backend cannot reproduce; names the config key and value."""


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be loaded; names the folder and what is missing."""


class TrainerRankLost(RuntimeError):
    """A trainer rank's process or node is gone: the run stops; ``--load`` resumes it."""


class DumpError(ValueError):
    """A dump that cannot be read or does not match the run; the message names the file."""


class TurnRecordsError(ValueError):
    pass


class InspectError(ValueError):
    """A run folder or dump that cannot be inspected; the message names it."""


# errors caused by the user's inputs (a flag, a file, a row, a plug-in, a full disk): reported as one line,
# exit code 2, no traceback; one raised in the rollout role during the run reaches every rank as it is
USER_ERRORS = (
    ConfigError,
    DatasetError,
    PluginError,
    ModelConfigError,
    LaunchError,
    TrainSetupError,
    AssetError,
    CheckpointError,
    DumpError,
)
