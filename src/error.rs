//! Error type shared by every module of the crate.
//!
//! Every variant names the values involved (rank, operation, expected vs found, file), following
//! Candle's convention of errors that carry their context.

use std::fmt::Display;
use std::path::PathBuf;
use std::time::Duration;

/// Errors raised by candle-fsdp.
///
/// The kinds a caller handles differently have variants of their own: a bad argument (a
/// value out of its range, a size, dtype or device mismatch, something missing, two settings
/// in conflict: [`Error::Value`], [`Error::OutOfRange`], [`Error::Shape`], [`Error::DType`],
/// [`Error::Device`], [`Error::Missing`], [`Error::NoMatch`], [`Error::Conflict`],
/// [`Error::Env`], and [`Error::InvalidArgument`] for the rest), the runtime's protocol used out of order ([`Error::Misuse`]),
/// ranks that disagree ([`Error::RanksDisagree`], [`Error::CollectiveMismatch`]), a unit that
/// autograd does not connect ([`Error::Disconnected`]), a broken invariant of the runtime
/// ([`Error::Internal`]), and the failures of communication, files and devices. More may be
/// added: match with a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another rank failed (returned an error or panicked) while this rank had a collective
    /// pending or issued a new one afterwards.
    #[error("{op} on rank {rank} aborted: rank {failed_rank} failed: {reason}")]
    PeerFailed {
        /// Operation that was aborted on this rank, e.g. `all_gather #12 (stream all_gather)`.
        op: String,
        /// This rank.
        rank: usize,
        /// The rank that failed first.
        failed_rank: usize,
        /// What that rank reported (its error message or panic payload).
        reason: String,
    },
    /// A rank left the group (its closure returned) while the others still waited for it.
    #[error("{op} on rank {rank}: rank {departed} already exited without joining this collective")]
    PeerExited {
        /// Operation that cannot complete.
        op: String,
        /// This rank.
        rank: usize,
        /// The rank that left.
        departed: usize,
    },
    /// A collective did not complete within the process group's timeout.
    #[error("{op} on rank {rank} timed out after {timeout:?} waiting for ranks {missing:?}")]
    Timeout {
        /// Operation that timed out.
        op: String,
        /// This rank.
        rank: usize,
        /// The configured timeout.
        timeout: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// Ranks called a collective with incompatible arguments (length, dtype, root, operation).
    #[error("{op}: rank {rank} passed {found} but rank {other_rank} passed {expected}")]
    CollectiveMismatch {
        /// Operation.
        op: String,
        /// Rank whose argument differs.
        rank: usize,
        /// What that rank passed.
        found: String,
        /// Reference rank.
        other_rank: usize,
        /// What the reference rank passed.
        expected: String,
    },
    /// A buffer of the wrong size or dtype was handed to a collective on one rank.
    #[error("{op} on rank {rank}: {what}: expected {expected}, found {found}")]
    BadBuffer {
        /// Operation.
        op: String,
        /// This rank.
        rank: usize,
        /// Which buffer.
        what: String,
        /// Expected length/dtype.
        expected: String,
        /// Found length/dtype.
        found: String,
    },
    /// Invalid configuration or argument that none of the typed variants below describes
    /// (a value given by the caller, the message says which and why). The common failures have
    /// variants of their own, whose fields a caller can match: [`Error::Value`],
    /// [`Error::OutOfRange`], [`Error::Shape`], [`Error::DType`], [`Error::Device`],
    /// [`Error::Missing`], [`Error::NoMatch`], [`Error::Conflict`], [`Error::Env`]. All of them
    /// are displayed with the prefix `invalid argument: `.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A value outside the values it may take: a size of 0, an epsilon that is not a positive
    /// finite number, a name that is none of the accepted ones (a device, a sharding strategy,
    /// a precision). Displayed as `"invalid argument: {what} must be {expected}, found
    /// {found}"`, e.g. `"invalid argument: GPT n_layer must be at least 1, found 0"`.
    #[error("invalid argument: {what} must be {expected}, found {found}")]
    Value {
        /// The value's name, with its owner where it helps, e.g. `GPT n_layer`,
        /// `BatchLoader: batch_size`, `sharding strategy`.
        what: String,
        /// What it may be, as a phrase, e.g. `at least 1`, `a positive finite number`,
        /// `full-shard, shard-grad-op, no-shard, hybrid-shard or hybrid-shard-grad-op`.
        expected: String,
        /// The value given, as written (a name quoted, e.g. `"fulll-shard"`).
        found: String,
    },
    /// An index or a rank at or past the end of what it indexes. Displayed as `"invalid
    /// argument: {what} {value} is out of range for {of} {bound} (expected 0..{bound})"`, e.g.
    /// `"invalid argument: store: rank 2 is out of range for world size 2 (expected 0..2)"`.
    #[error(
        "invalid argument: {what} {value} is out of range for {of} {bound} (expected 0..{bound})"
    )]
    OutOfRange {
        /// What the value indexes, e.g. `store: rank`, `unit index`.
        what: String,
        /// The index given.
        value: usize,
        /// What `bound` counts, e.g. `world size`, `the model's unit count`.
        of: String,
        /// The exclusive upper bound (the count of what is indexed).
        bound: usize,
    },
    /// Two sizes that must agree do not: element counts, lengths, shapes, byte counts.
    /// Displayed as `"invalid argument: {what}: expected {expected}, found {found}"`, e.g.
    /// `"invalid argument: store key \"id\": expected 128 bytes, found 4"`.
    #[error("invalid argument: {what}: expected {expected}, found {found}")]
    Shape {
        /// Which tensor, buffer or list, with its owner (kernel, unit, file).
        what: String,
        /// The size it must have, with its unit (`elements`, `bytes`, a shape `[2, 3]`) and
        /// where the expectation comes from when that is not obvious.
        expected: String,
        /// The size it has, in the same unit.
        found: String,
    },
    /// A tensor or a setting of a dtype that the operation does not take. Displayed as
    /// `"invalid argument: {what} must be {expected}, found {found:?}"`, e.g. `"invalid
    /// argument: AdamW state dtype must be f32 or bf16, found F16"`.
    #[error("invalid argument: {what} must be {expected}, found {found:?}")]
    DType {
        /// Which tensor or setting, with its owner, e.g. `adamw_step: param`.
        what: String,
        /// The dtypes accepted, as a phrase, e.g. `f32, bf16 or f16`.
        expected: String,
        /// The dtype given.
        found: candle_core::DType,
    },
    /// A tensor or a setting on a device the operation does not run on, or on another device
    /// than the tensors it goes with. Displayed as `"invalid argument: {what} is on {found:?}:
    /// expected {expected}"`, e.g. `"invalid argument: adamw_step: grad is on Cuda { gpu_id: 1
    /// }: expected the GPU of the other tensors"`.
    #[error("invalid argument: {what} is on {found:?}: expected {expected}")]
    Device {
        /// Which tensor or setting, with its owner.
        what: String,
        /// The device it must be on, as a phrase (and the fix, where there is one).
        expected: String,
        /// Where it is.
        found: candle_core::DeviceLocation,
    },
    /// Something asked for is not there: a unit or parameter group by name, a file of a model
    /// directory, a buffer of the optimizer state, the parameters an operation needs.
    /// Displayed as `"invalid argument: no {what}; {detail}"`, e.g. `"invalid argument: no unit
    /// named \"embed\"; the model's units are: emb, head"`.
    #[error("invalid argument: no {what}; {detail}")]
    Missing {
        /// What is missing and where it was looked for, e.g. `unit named "embed"`,
        /// `config.json in /models/x`.
        what: String,
        /// What is there instead, or why it is needed.
        detail: String,
    },
    /// A pattern (a glob of parameter names, a list of LoRA targets) that matches nothing.
    /// Displayed as `"invalid argument: {what} {pattern} matches no {among}; {known}"`, e.g.
    /// `"invalid argument: freeze pattern \"fc.wieght\" matches no parameter; the parameters
    /// are: fc.bias, fc.weight"`.
    #[error("invalid argument: {what} {pattern} matches no {among}; {known}")]
    NoMatch {
        /// Which pattern, e.g. `freeze pattern`, `LoRA: the target list`.
        what: String,
        /// The pattern as given (quoted).
        pattern: String,
        /// What it is matched against, singular, e.g. `parameter`.
        among: String,
        /// The candidates, e.g. `the parameters are: fc.bias, fc.weight`.
        known: String,
    },
    /// Two settings (flags, options, the launcher and the build) that cannot go together.
    /// Displayed as `"invalid argument: {a} with {b}: {why}"`, e.g. `"invalid argument: --device
    /// cuda:0 with --world-size 9: the ranks of one process share the GPU as threads, 1 to 8 of
    /// them"`.
    #[error("invalid argument: {a} with {b}: {why}")]
    Conflict {
        /// The first setting, with its value, e.g. `--base-model`, `this process was started by
        /// mpirun`.
        a: String,
        /// The setting it conflicts with, with its value, e.g. `--format hf`.
        b: String,
        /// Why they conflict, and the way out.
        why: String,
    },
    /// An environment variable (of a launcher: `RANK`, `WORLD_SIZE`, `MASTER_PORT`,
    /// `LOCAL_RANK`, …) whose value is refused. Displayed as `"invalid argument: environment
    /// variable {var}={value} {problem}"`, e.g. `"invalid argument: environment variable
    /// MASTER_PORT=\"x\" is not a TCP port (1..=65535)"`.
    #[error("invalid argument: environment variable {var}={value} {problem}")]
    Env {
        /// The variable's name.
        var: String,
        /// Its value as set (a string that does not parse is quoted; a number is not).
        value: String,
        /// What is wrong with it, as a phrase starting with a verb, e.g. `is not a TCP port
        /// (1..=65535)`.
        problem: String,
    },
    /// The runtime's protocol used out of order, e.g. `backward` without a training forward:
    /// what was called, the state it was called in, and the fix to type. Displayed as
    /// `"{call} {state}: {fix}"`.
    #[error("{call} {state}: {fix}")]
    Misuse {
        /// What was called, e.g. `backward`, `optimizer step`.
        call: &'static str,
        /// The state it was called in, as a phrase, e.g. `called without a preceding training
        /// forward`.
        state: &'static str,
        /// Why it is refused and what to call instead.
        fix: String,
    },
    /// Ranks that must agree on something (the model they built, the groups a forward
    /// gathered) do not; every rank fails with it at once instead of hanging in a collective.
    /// Displayed as `"the ranks {what}: rank {rank} {detail}"`.
    #[error("the ranks {what}: rank {rank} {detail}")]
    RanksDisagree {
        /// What differs, as a phrase, e.g. `built different models`.
        what: &'static str,
        /// This rank.
        rank: usize,
        /// This rank's side and what every rank must do.
        detail: String,
    },
    /// Autograd does not connect a unit's outputs to its parameters or inputs (an operation
    /// without backward inside the unit, e.g. candle-nn 0.11's fused `layer_norm`): the units
    /// below would silently get no gradient. `what` is the whole message, naming the unit and
    /// the parameter or input.
    #[error("{what}")]
    Disconnected {
        /// The unit.
        unit: String,
        /// What is not connected, and the fix.
        what: String,
    },
    /// An invariant of the runtime broke: a bug in candle-fsdp, not in the caller's code.
    #[error("internal error (a bug in candle-fsdp, please report it): {0}")]
    Internal(String),
    /// A tensor handed to one of the in-place kernels ([`crate::ops`]) is unfit for it: its
    /// dtype, layout, device or element count, or it shares storage with another argument.
    /// Displayed as `"{op}: {tensor} {problem}"`, e.g. `"adamw_step: grad must be F32, found
    /// BF16"`.
    #[error("{op}: {tensor} {problem}")]
    BadTensor {
        /// The kernel (its public name, e.g. `adamw_step`).
        op: String,
        /// The argument's name (`param`, `grad`, `exp_avg`, …).
        tensor: String,
        /// What is wrong, with the expected and the found value.
        problem: String,
    },
    /// A rank's closure panicked (reported by [`crate::comm::threads::run_ranks`]).
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// Rank that panicked.
        rank: usize,
        /// Panic payload as text.
        message: String,
    },
    /// Error from a data or checkpoint file.
    #[error("{path}: {message}")]
    File {
        /// File involved.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// I/O error with the file it concerns. The message includes the OS error, so it is not
    /// repeated as a separate cause.
    #[error("{path}: {error}")]
    Io {
        /// File involved.
        path: PathBuf,
        /// Underlying error.
        error: std::io::Error,
    },
    /// A phase that every rank runs (e.g. loading a checkpoint) failed on other ranks; their own
    /// errors say why. [`crate::comm::threads::run_ranks_ok`] reports theirs rather than this.
    #[error("{path}: {what} failed on rank(s) {failed_ranks:?}: {}", reasons.join("; "))]
    PeersFailed {
        /// What failed.
        what: String,
        /// File or directory involved.
        path: PathBuf,
        /// This rank.
        rank: usize,
        /// Ranks whose phase failed.
        failed_ranks: Vec<usize>,
        /// Each failed rank's error, `rank r: <message>` (at most 480 bytes of it), in the
        /// order of `failed_ranks`: under `mpirun` the failed rank's own output may be another
        /// process's, so the reason travels with the error.
        reasons: Vec<String>,
    },
    /// A comm stream's worker stopped (its thread exited or panicked) before completing an
    /// operation issued on it.
    #[error("{op} on rank {rank}: comm stream {stream} stopped before completing it")]
    StreamStopped {
        /// Operation that cannot complete.
        op: String,
        /// This rank.
        rank: usize,
        /// Name of the stream.
        stream: String,
    },
    /// A thread (rank or comm stream) could not be spawned.
    #[error("cannot spawn {what}: {error}")]
    SpawnFailed {
        /// Which thread, e.g. `comm stream all_gather of rank 1`.
        what: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// A call into the MPI library failed (the MPI backend sets errors to return, so failures
    /// come back as codes instead of aborting the job).
    #[error("{call} on rank {rank} failed: MPI error {code}: {message}")]
    Mpi {
        /// The MPI function (and what it was for), e.g. `MPI_Isend (all_gather #3)`.
        call: String,
        /// This rank (in `MPI_COMM_WORLD`).
        rank: usize,
        /// The MPI error code.
        code: i32,
        /// `MPI_Error_string` of the code.
        message: String,
    },
    /// A call into the CUDA driver, NVRTC or cuBLAS failed (feature `cuda`), or no GPU is there:
    /// the call and the driver's message.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An NCCL call failed or was aborted (feature `nccl`).
    #[error("{call} on rank {rank} failed: {message}")]
    Nccl {
        /// The NCCL function and what it was for, e.g. `ncclAllGather (all_gather #3)`.
        call: String,
        /// This rank in the group.
        rank: usize,
        /// NCCL's error (`ncclGetErrorString`, or the watchdog's reason for aborting).
        message: String,
    },
    /// The TCP key-value store that bootstraps a torchrun-style job ([`crate::launch::store`])
    /// failed on this rank: a rank did not join or reach a barrier in time, a key was not set in
    /// time, the server could not bind its port or went away, a registration was rejected. The
    /// message names the store's address and the ranks or key involved.
    #[error("rank {rank}: {message}")]
    Store {
        /// The store's address, `host:port`.
        addr: String,
        /// This rank.
        rank: usize,
        /// The ranks that did not join or arrive, when that is the failure (else empty).
        missing: Vec<usize>,
        /// What went wrong, naming the store's address, the key or barrier, and the OS error.
        message: String,
    },
    /// An error raised during one phase of a training step, with where it happened: the unit
    /// (when one was running), the phase and the step (counted from 0 by training forwards).
    #[error("{phase} of {} at step {step}: {source}", unit.as_deref().map_or("the model".to_string(), |u| format!("unit {u}")))]
    InStep {
        /// Unit that was running (or being gathered / reduced), if any.
        unit: Option<String>,
        /// Phase of the step.
        phase: Phase,
        /// Step number.
        step: u64,
        /// The underlying error.
        source: Box<Error>,
    },
    /// Error raised by Candle while running a unit.
    #[error(transparent)]
    Candle(candle_core::Error),
}

/// Phase of a training step, named in [`Error::InStep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// Training forward.
    Forward,
    /// Inference forward (`forward_eval`).
    Eval,
    /// Backward (including its all-gathers and reduce-scatters).
    Backward,
    /// Optimizer step (including clipping and the grad scaler).
    Optimizer,
    /// Saving or loading a checkpoint, or gathering a state dict.
    Checkpoint,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Eval => "eval forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer step",
            Phase::Checkpoint => "checkpoint",
        })
    }
}

impl From<candle_core::Error> for Error {
    /// Keeps our own variant when Candle carries it (an error of ours returned from inside a
    /// Candle op, e.g. SyncBatchNorm's all-reduce, wrapped with [`Error::into_candle`], possibly
    /// under Candle's `Context` / `WithBacktrace` layers), so a comm error stays a comm error.
    fn from(e: candle_core::Error) -> Self {
        match e {
            candle_core::Error::WrappedContext { wrapped, context } => {
                match wrapped.downcast::<Error>() {
                    Ok(ours) => *ours,
                    Err(wrapped) => {
                        Error::Candle(candle_core::Error::WrappedContext { wrapped, context })
                    }
                }
            }
            candle_core::Error::WithBacktrace { inner, backtrace } => match Error::from(*inner) {
                Error::Candle(c) => Error::Candle(candle_core::Error::WithBacktrace {
                    inner: Box::new(c),
                    backtrace,
                }),
                ours => ours,
            },
            candle_core::Error::Context { inner, context } => match Error::from(*inner) {
                Error::Candle(c) => Error::Candle(candle_core::Error::Context {
                    inner: Box::new(c),
                    context,
                }),
                ours => ours,
            },
            other => Error::Candle(other),
        }
    }
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error: source,
        }
    }

    /// Wraps this error with where it happened in a step (see [`Error::InStep`]). An error that
    /// already carries a place is returned unchanged (the innermost place is the most precise).
    pub fn in_step(self, unit: Option<&str>, phase: Phase, step: u64) -> Self {
        match self {
            e @ Error::InStep { .. } => e,
            e => Error::InStep {
                unit: unit.map(str::to_string),
                phase,
                step,
                source: Box::new(e),
            },
        }
    }

    /// True when the root cause is a collective's failure (a peer failed or left, a timeout,
    /// mismatched or bad buffers, a stopped stream): the errors that need a place to be
    /// understood.
    pub fn is_comm(&self) -> bool {
        matches!(
            self.root_cause(),
            Error::PeerFailed { .. }
                | Error::PeerExited { .. }
                | Error::Timeout { .. }
                | Error::CollectiveMismatch { .. }
                | Error::BadBuffer { .. }
                | Error::StreamStopped { .. }
                | Error::Mpi { .. }
                | Error::Nccl { .. }
        )
    }

    /// Adds the checkpoint phase and `step` to a collective's error (see [`Error::is_comm`]);
    /// other errors of a checkpoint already name their file and are returned unchanged.
    pub fn in_checkpoint(self, step: u64) -> Self {
        if self.is_comm() {
            self.in_step(None, Phase::Checkpoint, step)
        } else {
            self
        }
    }

    /// The error under any [`Error::InStep`] context: the variant that says what went wrong
    /// (e.g. [`Error::PeerFailed`] or [`Error::Timeout`]).
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::InStep { source, .. } => source.root_cause(),
            e => e,
        }
    }

    /// Converts this error into a Candle error that [`From<candle_core::Error>`] turns back into
    /// this very variant (for errors raised inside Candle ops and module forwards).
    pub fn into_candle(self) -> candle_core::Error {
        candle_core::Error::WrappedContext {
            wrapped: Box::new(self),
            context: "candle-fsdp".to_string(),
        }
    }

    /// This error's text without the stack traces Candle attaches when `RUST_BACKTRACE` is set
    /// (`candle_core::Error::WithBacktrace`, at any depth under [`Error::InStep`] and Candle's
    /// `Context` / `WithPath` layers). This is the text a failing rank sends to the others in
    /// its abort notice: its own stack would be noise in their messages, and several processes'
    /// multi-line traces interleave on a shared terminal.
    pub fn message(&self) -> String {
        fn traces(e: &candle_core::Error, out: &mut Vec<String>) {
            match e {
                candle_core::Error::WithBacktrace { inner, backtrace } => {
                    out.push(format!("\n{backtrace}"));
                    traces(inner, out);
                }
                candle_core::Error::Context { inner, .. }
                | candle_core::Error::WithPath { inner, .. } => traces(inner, out),
                _ => {}
            }
        }
        let mut found = Vec::new();
        let mut e = self;
        while let Error::InStep { source, .. } = e {
            e = source;
        }
        if let Error::Candle(c) = e {
            traces(c, &mut found);
        }
        let mut text = self.to_string();
        for trace in found.iter().filter(|t| t.len() > 1) {
            text = text.replacen(trace.as_str(), "", 1);
        }
        text
    }

    /// True for the bad-argument variants ([`Error::InvalidArgument`], [`Error::Value`],
    /// [`Error::OutOfRange`], [`Error::Shape`], [`Error::DType`], [`Error::Device`],
    /// [`Error::Missing`], [`Error::NoMatch`], [`Error::Conflict`], [`Error::Env`]), whose
    /// message starts with `invalid argument: `.
    pub fn is_argument(&self) -> bool {
        matches!(
            self,
            Error::InvalidArgument(_)
                | Error::Value { .. }
                | Error::OutOfRange { .. }
                | Error::Shape { .. }
                | Error::DType { .. }
                | Error::Device { .. }
                | Error::Missing { .. }
                | Error::NoMatch { .. }
                | Error::Conflict { .. }
                | Error::Env { .. }
        )
    }

    /// The message of a bad-argument variant without its `invalid argument: ` prefix (for
    /// callers that put it in a sentence of their own, e.g. naming the file it came from);
    /// `None` for the other variants.
    pub fn argument_text(&self) -> Option<String> {
        if !self.is_argument() {
            return None;
        }
        let text = self.to_string();
        Some(match text.strip_prefix("invalid argument: ") {
            Some(rest) => rest.to_string(),
            None => text,
        })
    }

    /// A bad-argument error (see [`Error::is_argument`]) with `prefix` (e.g. `unit fc2`) put
    /// before what it names: `"{prefix}: {what}"`; other errors unchanged.
    pub(crate) fn prefixed(self, prefix: &str) -> Self {
        let p = |s: String| format!("{prefix}: {s}");
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(p(m)),
            Error::Value {
                what,
                expected,
                found,
            } => Error::Value {
                what: p(what),
                expected,
                found,
            },
            Error::Shape {
                what,
                expected,
                found,
            } => Error::Shape {
                what: p(what),
                expected,
                found,
            },
            Error::DType {
                what,
                expected,
                found,
            } => Error::DType {
                what: p(what),
                expected,
                found,
            },
            Error::Device {
                what,
                expected,
                found,
            } => Error::Device {
                what: p(what),
                expected,
                found,
            },
            Error::OutOfRange {
                what,
                value,
                of,
                bound,
            } => Error::OutOfRange {
                what: p(what),
                value,
                of,
                bound,
            },
            Error::NoMatch {
                what,
                pattern,
                among,
                known,
            } => Error::NoMatch {
                what: p(what),
                pattern,
                among,
                known,
            },
            Error::Conflict { a, b, why } => Error::Conflict { a: p(a), b, why },
            other => other,
        }
    }

    /// [`Error::Value`]: `what` must be `expected`, found `found`.
    pub fn value(what: impl Display, expected: impl Display, found: impl Display) -> Self {
        Error::Value {
            what: what.to_string(),
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    /// [`Error::OutOfRange`]: `what` `value` is out of range for `of` `bound`.
    pub fn out_of_range(what: impl Display, value: usize, of: impl Display, bound: usize) -> Self {
        Error::OutOfRange {
            what: what.to_string(),
            value,
            of: of.to_string(),
            bound,
        }
    }

    /// [`Error::Shape`]: `what`: expected `expected`, found `found`.
    pub fn shape(what: impl Display, expected: impl Display, found: impl Display) -> Self {
        Error::Shape {
            what: what.to_string(),
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    /// [`Error::DType`]: `what` must be `expected`, found `found`.
    pub fn dtype(what: impl Display, expected: impl Display, found: candle_core::DType) -> Self {
        Error::DType {
            what: what.to_string(),
            expected: expected.to_string(),
            found,
        }
    }

    /// [`Error::Device`]: `what` is on `found`: expected `expected`.
    pub fn device(
        what: impl Display,
        expected: impl Display,
        found: candle_core::DeviceLocation,
    ) -> Self {
        Error::Device {
            what: what.to_string(),
            expected: expected.to_string(),
            found,
        }
    }

    /// [`Error::Missing`]: no `what`; `detail`.
    pub fn missing(what: impl Display, detail: impl Display) -> Self {
        Error::Missing {
            what: what.to_string(),
            detail: detail.to_string(),
        }
    }

    /// [`Error::NoMatch`]: `what` `pattern` matches no `among`; `known`.
    pub fn no_match(
        what: impl Display,
        pattern: impl Display,
        among: impl Display,
        known: impl Display,
    ) -> Self {
        Error::NoMatch {
            what: what.to_string(),
            pattern: pattern.to_string(),
            among: among.to_string(),
            known: known.to_string(),
        }
    }

    /// [`Error::Conflict`]: `a` with `b`: `why`.
    pub fn conflict(a: impl Display, b: impl Display, why: impl Display) -> Self {
        Error::Conflict {
            a: a.to_string(),
            b: b.to_string(),
            why: why.to_string(),
        }
    }

    /// [`Error::Env`]: environment variable `var`=`value` `problem`.
    pub fn env(var: impl Display, value: impl Display, problem: impl Display) -> Self {
        Error::Env {
            var: var.to_string(),
            value: value.to_string(),
            problem: problem.to_string(),
        }
    }

    /// A data or checkpoint file problem.
    pub fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::File {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Candle's stack traces (at any depth) are left out of `message`, and only they.
    #[test]
    fn message_leaves_out_candle_stack_traces() {
        let traced = candle_core::Error::WithBacktrace {
            inner: Box::new(candle_core::Error::Msg("injected".into())),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        }
        .context("in the user's module");
        let e = Error::from(traced).in_step(Some("block"), Phase::Forward, 5);
        let full = e.to_string();
        assert!(full.lines().count() > 2, "no trace to leave out: {full}");
        assert_eq!(
            e.message(),
            "forward of unit block at step 5: in the user's module\ninjected"
        );
        let plain = Error::InvalidArgument("bad\nvalue".into());
        assert_eq!(plain.message(), plain.to_string());
    }
}
