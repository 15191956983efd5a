//! Local buffers of a collective and the checks every backend runs on them: what one rank posts
//! for a collective ([`Post`]: kind, sequence number, buffer lengths and dtypes, reduce op, root,
//! setup argument, local problem), the deterministic validation of every rank's post
//! ([`validate`]; the same verdict on every rank), and access to a CPU tensor's storage under
//! Candle's in-place op locks ([`with_checked_bufs`]).
//!
//! The thread backend posts these through its shared rendezvous; shared memory, TCP and MPI
//! encode them into a small descriptor (`comm::wire`) exchanged before the data moves (NCCL
//! validates its own post alone). Every backend therefore fails the same way, with the same
//! [`Error::BadBuffer`] or [`Error::CollectiveMismatch`] on every rank.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, DeviceLocation, Layout, Tensor};
use serde::{Deserialize, Serialize};

use crate::comm::bootstrap::cut_reason;
use crate::comm::{wire, Call, OpKind, ReduceOp};
use crate::device::{with_storage_mut, Refused, StorageMut, StorageRef};
use crate::error::{Error, Result};

/// Kind of a rendezvous: a collective, or one of the setup operations run on the caller's thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Kind {
    Op(OpKind),
    NewStream,
    NewGroup,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Op(k) => k.name(),
            Kind::NewStream => "new_stream",
            Kind::NewGroup => "new_group",
        }
    }
}

/// Address, length and dtype of one rank's buffer, as posted to the communicator.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct RawBuf {
    /// Not sent to peers (a decoded buffer's address is null).
    #[serde(skip, default = "std::ptr::null_mut")]
    pub ptr: *mut u8,
    pub len: usize,
    #[serde(with = "wire::dtype")]
    pub dtype: DType,
}

// SAFETY: a `RawBuf` is a plain address; it is only dereferenced by the collective code, under
// the rendezvous protocol that keeps the buffer alive, unmoved and free of conflicting accesses
// while peers use it (see `Ctx::rendezvous` and the SAFETY comments at each access).
unsafe impl Send for RawBuf {}
// SAFETY: as above; sharing the address itself is harmless.
unsafe impl Sync for RawBuf {}

/// Name of a buffer in a [`Problem`]: `input`, `output` or `buffer` (the thread backend's
/// `which`). An alias because serde's derive takes a field written `&'static str` for text
/// borrowed from the encoded bytes; [`wire::which`] finds the decoded name among these instead.
pub(crate) type Which = &'static str;

/// A buffer this rank cannot take part with, detected locally and reported through the
/// rendezvous so that every rank fails the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Problem {
    NotOnCpu {
        #[serde(deserialize_with = "wire::which")]
        which: Which,
        #[serde(with = "wire::Location")]
        found: DeviceLocation,
    },
    NotOneD {
        #[serde(deserialize_with = "wire::which")]
        which: Which,
        dims: usize,
    },
    NotContiguous {
        #[serde(deserialize_with = "wire::which")]
        which: Which,
    },
    Dtype {
        #[serde(deserialize_with = "wire::which")]
        which: Which,
        #[serde(with = "wire::dtype")]
        dtype: DType,
    },
    /// Candle refused in-place access: the output shares storage with the input.
    Aliased,
    /// Not on the group's device (device backends: the thread backend on CUDA, NCCL). `found` is
    /// the tensor's location; `other_device` is true when that location is the group's GPU
    /// but the tensor belongs to another Candle device (another rank's compute stream).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    WrongDevice {
        #[serde(deserialize_with = "wire::which")]
        which: Which,
        #[serde(with = "wire::Location")]
        expected: DeviceLocation,
        #[serde(with = "wire::Location")]
        found: DeviceLocation,
        other_device: bool,
    },
    /// The setup argument (`arg` bytes) makes the descriptor `found` bytes long where the
    /// backend takes at most `max` ([`crate::comm::wire::encode_within`]).
    TooLong {
        arg: usize,
        found: usize,
        max: usize,
    },
}

/// `cpu` or `cuda:N` (`metal:N`), as the examples' `--device` spells it.
pub(crate) fn location_name(l: DeviceLocation) -> String {
    match l {
        DeviceLocation::Cpu => "cpu".to_string(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

impl Problem {
    /// The [`Error::BadBuffer`] this problem is on `rank`, for a collective of kind `kind`
    /// named `op` (the wording [`validate`] uses).
    pub(crate) fn to_error(self, op: &str, rank: usize, kind: Kind) -> Error {
        let (which, expected, found) = match self {
            Problem::NotOnCpu { which, found } => {
                (which, "a tensor on the CPU".into(), format!("{found:?}"))
            }
            Problem::NotOneD { which, dims } => (
                which,
                "a 1-D tensor".into(),
                format!("a tensor of {dims} dimensions"),
            ),
            Problem::NotContiguous { which } => {
                (which, "a contiguous tensor".into(), "a strided view".into())
            }
            Problem::Dtype { which, dtype } => (
                which,
                "f32, bf16, f16, f64, u8, u32, i16, i32 or i64".into(),
                format!("{dtype:?}"),
            ),
            Problem::Aliased => (
                "output",
                "storage distinct from the input's".into(),
                "the input's storage".into(),
            ),
            Problem::WrongDevice {
                which,
                expected,
                found,
                other_device,
            } => (
                which,
                format!(
                    "a tensor on this rank's device ({})",
                    location_name(expected)
                ),
                if other_device {
                    format!(
                        "a tensor of another Candle device on {} (another rank's compute \
                         stream; create buffers on `pg.device()`)",
                        location_name(found)
                    )
                } else {
                    format!("a tensor on {}", location_name(found))
                },
            ),
            Problem::TooLong { arg, found, max } => (
                "setup argument",
                format!(
                    "at most {} bytes (the backend's limit: a descriptor of at most {max} \
                     bytes)",
                    max.saturating_sub(found - arg)
                ),
                format!("{arg} bytes (a descriptor of {found} bytes)"),
            ),
        };
        Error::BadBuffer {
            op: op.to_string(),
            rank,
            what: format!("{} {which}", kind.name()),
            expected,
            found,
        }
    }
}

/// What one rank published for one rendezvous (its wire form: [`wire::encode`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Post {
    pub kind: Kind,
    pub seq: u64,
    pub input: Option<RawBuf>,
    pub output: Option<RawBuf>,
    pub op: Option<ReduceOp>,
    pub root: Option<usize>,
    /// Setup argument: the stream name (`NewStream`) or the ranks (`NewGroup`, native-endian
    /// `usize`s); `None` for a collective (nothing allocated per operation).
    pub bytes: Option<Vec<u8>>,
    /// `NewStream`: index of the stream among the streams this rank created.
    pub index: Option<usize>,
    pub problem: Option<Problem>,
}

impl Post {
    pub(crate) fn new(kind: Kind, seq: u64) -> Post {
        Post {
            kind,
            seq,
            input: None,
            output: None,
            op: None,
            root: None,
            bytes: None,
            index: None,
            problem: None,
        }
    }

    /// The post of collective `call` (sequence number `seq`) on this rank's buffers: `dst` the
    /// output or in-place buffer, `src` the input of all-gather and reduce-scatter. What every
    /// host backend publishes before the data moves.
    pub(crate) fn of_call(call: Call, seq: u64, dst: RawBuf, src: Option<RawBuf>) -> Post {
        let mut post = Post::new(Kind::Op(call.kind()), seq);
        post.input = Some(src.unwrap_or(dst));
        post.output = src.map(|_| dst);
        post.op = call.op();
        if let Call::Broadcast(root) | Call::Reduce(root, _) = call {
            post.root = Some(root);
        }
        post
    }
}

/// The dtypes the thread backend moves and reduces.
pub(crate) fn supported(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32
            | DType::BF16
            | DType::F16
            | DType::F64
            | DType::U8
            | DType::U32
            | DType::I16
            | DType::I32
            | DType::I64
    )
}

/// `name` as operation names and errors show it: whole up to 64 bytes, else its first 48 bytes
/// (at a character boundary), an ellipsis and its length, so that a long stream name does not
/// fill every message that quotes it.
pub(crate) fn shortened(name: &str) -> std::borrow::Cow<'_, str> {
    if name.len() <= 64 {
        return name.into();
    }
    format!("{}… ({} bytes)", cut_reason(name, 48), name.len()).into()
}

/// `ranks` as operation names and errors show them: whole up to 16, else the first 8, an
/// ellipsis and the count.
pub(crate) fn rank_list(ranks: &[usize]) -> String {
    if ranks.len() <= 16 {
        return format!("{ranks:?}");
    }
    let head: Vec<String> = ranks[..8].iter().map(usize::to_string).collect();
    format!("[{}, … ({} ranks)]", head.join(", "), ranks.len())
}

fn describe_call(p: &Post) -> String {
    format!("{} #{}", p.kind.name(), p.seq)
}

/// A setup argument as text, for mismatch errors.
fn describe_bytes(kind: Kind, b: &Option<Vec<u8>>) -> String {
    let bytes = b.as_deref().unwrap_or_default();
    match kind {
        Kind::NewGroup => {
            let ranks: Vec<usize> = bytes
                .chunks_exact(std::mem::size_of::<usize>())
                .map(|c| usize::from_ne_bytes(c.try_into().expect("usize-sized chunk")))
                .collect();
            format!("ranks {}", rank_list(&ranks))
        }
        _ => format!("name {:?}", shortened(&String::from_utf8_lossy(bytes))),
    }
}

/// Checks every rank's post; deterministic, so every rank reaches the same verdict.
pub(crate) fn validate(op: &str, world_size: usize, posts: &[Post]) -> Result<()> {
    let p0 = &posts[0];
    let mismatch = |rank: usize, found: String, expected: String| Error::CollectiveMismatch {
        op: op.to_string(),
        rank,
        found,
        other_rank: 0,
        expected,
    };
    for (j, p) in posts.iter().enumerate().skip(1) {
        if p.kind != p0.kind || p.seq != p0.seq {
            return Err(mismatch(j, describe_call(p), describe_call(p0)));
        }
    }
    // Buffers a rank could not take part with.
    if let Some((j, problem)) = posts
        .iter()
        .enumerate()
        .find_map(|(j, p)| p.problem.map(|pr| (j, pr)))
    {
        return Err(problem.to_error(op, j, p0.kind));
    }
    for (j, p) in posts.iter().enumerate() {
        // This rank's own buffers must be consistent with each other.
        if let (Some(input), Some(output)) = (&p.input, &p.output) {
            let what = p.kind.name();
            if output.dtype != input.dtype {
                return Err(Error::BadBuffer {
                    op: op.to_string(),
                    rank: j,
                    what: format!("{what} output dtype"),
                    expected: format!("{:?} (the input dtype)", input.dtype),
                    found: format!("{:?}", output.dtype),
                });
            }
            let (whole, shard, whole_name, shard_name) = match p.kind {
                Kind::Op(OpKind::AllGather) => (output, input, "output", "input"),
                _ => (input, output, "input", "output"),
            };
            if world_size.checked_mul(shard.len) != Some(whole.len) {
                return Err(Error::BadBuffer {
                    op: op.to_string(),
                    rank: j,
                    what: format!("{what} {whole_name} length"),
                    expected: format!(
                        "{} elements (world_size {world_size} x {shard_name} {})",
                        world_size.saturating_mul(shard.len),
                        shard.len
                    ),
                    found: format!("{} elements", whole.len),
                });
            }
        }
        if j == 0 {
            continue;
        }
        // ... and agree with rank 0's.
        if let (Some(a), Some(b)) = (&p.input, &p0.input) {
            if a.dtype != b.dtype {
                return Err(mismatch(
                    j,
                    format!("{:?} buffers", a.dtype),
                    format!("{:?} buffers", b.dtype),
                ));
            }
            if a.len != b.len {
                return Err(mismatch(
                    j,
                    format!("an input of {} elements", a.len),
                    format!("an input of {} elements", b.len),
                ));
            }
        }
        // The text is formatted only on a mismatch: this runs for every collective. The fields
        // are set by the collective's kind (checked equal above): `none` is what a rank that
        // passed none of them says.
        macro_rules! agree {
            ($($field:ident: $some:literal / $none:literal),*) => {$(
                if p.$field != p0.$field {
                    let say = |v: &Option<_>| match v {
                        Some(v) => format!(concat!($some, "{:?}"), v),
                        None => $none.to_string(),
                    };
                    return Err(mismatch(j, say(&p.$field), say(&p0.$field)));
                }
            )*};
        }
        agree!(
            op: "ReduceOp::" / "no reduce op",
            root: "root " / "no root",
            index: "stream index " / "no stream index"
        );
        if p.bytes != p0.bytes {
            return Err(mismatch(
                j,
                describe_bytes(p.kind, &p.bytes),
                describe_bytes(p0.kind, &p0.bytes),
            ));
        }
    }
    if let Some(root) = p0.root {
        if root >= world_size {
            return Err(Error::out_of_range(
                format_args!("{op}: root"),
                root,
                "world size",
                world_size,
            ));
        }
    }
    if let (Some(ReduceOp::Avg), Some(b)) = (p0.op, &p0.input) {
        if !b.dtype.is_float() {
            return Err(Error::dtype(
                format_args!("{op}: a buffer of ReduceOp::Avg"),
                "a float dtype (integer dtypes support Sum, Max and Min)",
                b.dtype,
            ));
        }
    }
    Ok(())
}

/// The first reason `t` cannot be posted as `which` to a group whose buffers live on `device`
/// (the same Candle device: on CUDA, the rank's own compute stream), if any: another device,
/// not 1-D, strided, or an unsupported dtype.
pub(crate) fn check_on(t: &Tensor, which: &'static str, device: &Device) -> Option<Problem> {
    let found = t.device().location();
    if device.is_cpu() && found != DeviceLocation::Cpu {
        return Some(Problem::NotOnCpu { which, found });
    }
    if !device.is_cpu() && !t.device().same_device(device) {
        let expected = device.location();
        let other_device = found == expected;
        return Some(Problem::WrongDevice {
            which,
            expected,
            found,
            other_device,
        });
    }
    if t.rank() != 1 {
        let dims = t.rank();
        return Some(Problem::NotOneD { which, dims });
    }
    if !t.is_contiguous() {
        return Some(Problem::NotContiguous { which });
    }
    if !supported(t.dtype()) {
        let dtype = t.dtype();
        return Some(Problem::Dtype { which, dtype });
    }
    None
}

/// The first reason a collective's buffers cannot be posted to a group on `device` ([`check_on`]):
/// `dst`, the output (or the in-place `buffer` when there is no input), and its input `src`.
pub(crate) fn problem(dst: &Tensor, src: Option<&Tensor>, device: &Device) -> Option<Problem> {
    let which = if src.is_some() { "output" } else { "buffer" };
    src.and_then(|s| check_on(s, "input", device))
        .or_else(|| check_on(dst, which, device))
}

/// Start address and length (elements) of a storage's vector.
macro_rules! storage_vec {
    ($storage:expr, $as_ptr:ident) => {
        match $storage {
            CpuStorage::U8(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::U32(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::I16(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::I32(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::I64(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::BF16(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::F16(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::F32(v) => (v.$as_ptr() as *mut u8, v.len()),
            CpuStorage::F64(v) => (v.$as_ptr() as *mut u8, v.len()),
            // Refused by `check` (unsupported dtypes) before any storage access.
            _ => (std::ptr::null_mut(), 0),
        }
    };
}

/// The tensor's elements inside `storage`: the address of element `layout.start_offset()`.
fn raw(base: *mut u8, vec_len: usize, storage: &CpuStorage, layout: &Layout) -> RawBuf {
    let dtype = storage.dtype();
    let (start, end) = layout
        .contiguous_offsets()
        .expect("contiguity checked before the storage is accessed");
    assert!(
        end <= vec_len,
        "layout {start}..{end} beyond storage {vec_len}"
    );
    RawBuf {
        // In bounds of the allocation (start <= end <= vec_len).
        ptr: base.wrapping_add(start * dtype.size_in_bytes()),
        len: end - start,
        dtype,
    }
}

/// A buffer this rank only reads (and peers read).
fn raw_read(storage: &CpuStorage, layout: &Layout) -> RawBuf {
    let (base, len) = storage_vec!(storage, as_ptr);
    raw(base, len, storage, layout)
}

/// A buffer this rank writes.
fn raw_write(storage: &mut CpuStorage, layout: &Layout) -> RawBuf {
    let (base, len) = storage_vec!(&mut *storage, as_mut_ptr);
    raw(base, len, storage, layout)
}

/// Reports a local `problem` with collective `kind` (sequence number `seq`) through `exchange`,
/// which posts it to every rank: returns the error every rank then gets (validation refuses the
/// post on every rank).
pub(crate) fn report(
    kind: Kind,
    seq: u64,
    problem: Problem,
    exchange: impl FnOnce(&Post) -> Result<()>,
) -> Error {
    let mut post = Post::new(kind, seq);
    post.problem = Some(problem);
    exchange(&post).expect_err("validation refuses a post with a problem")
}

/// Runs a host backend's collective `kind` (sequence number `seq`) on the raw buffers of `dst`
/// (written) and `src` (read), both CPU tensors, under Candle's storage locks for the whole call
/// ([`crate::device::with_storage_mut`]). A buffer this rank cannot use ([`problem`], or an
/// output that Candle refused because it shares storage with the input) takes part in the
/// descriptor exchange (`exchange`) only to report why ([`report`]).
pub(crate) fn with_checked_bufs<X>(
    x: &mut X,
    kind: OpKind,
    seq: u64,
    dst: &Tensor,
    src: Option<&Tensor>,
    exchange: fn(&mut X, &Post) -> Result<()>,
    body: impl FnOnce(&mut X, RawBuf, Option<RawBuf>) -> Result<()>,
) -> Result<()> {
    let kind = Kind::Op(kind);
    if let Some(problem) = problem(dst, src, &Device::Cpu) {
        return Err(report(kind, seq, problem, |post| exchange(x, post)));
    }
    let ran = with_storage_mut(dst, src, "thread-collective", |d, dl, s| {
        let StorageMut::Cpu(d) = d else {
            return None;
        };
        let src = match s {
            None => None,
            Some((StorageRef::Cpu(s), sl)) => Some(raw_read(s, sl)),
            Some((StorageRef::Cuda(_), _)) => return None,
        };
        Some(body(&mut *x, raw_write(d, dl), src))
    });
    match ran {
        Ok(Some(result)) => result,
        // Refused: the output shares storage with the input (or not CPU tensors, which
        // `problem` already excluded).
        Ok(None) | Err(Refused(_)) => Err(report(kind, seq, Problem::Aliased, |post| {
            exchange(x, post)
        })),
    }
}
