//! The descriptor of a collective (MPI: sent to every peer; shared memory: written to the
//! rank's segment header) before data moves: its
//! [`Post`] (kind, sequence number, buffer lengths and dtypes, reduce op, root, stream index,
//! setup argument, local problem) in a small little-endian byte string. Every rank decodes all
//! of them and runs the same [`crate::comm::buffer::validate`] as the thread backend, so a
//! mismatch is the same error on every rank instead of a hang or garbage.

use candle_core::{DType, DeviceLocation};

use crate::comm::buffer::{Kind, Post, Problem, RawBuf, RawBytes};
use crate::comm::{OpKind, ReduceOp};

/// Largest descriptor of a collective (bytes); setup descriptors carry their argument too.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) const OP_DESC_MAX: usize = 128;

const KINDS: [Kind; 8] = [
    Kind::Op(OpKind::AllGather),
    Kind::Op(OpKind::ReduceScatter),
    Kind::Op(OpKind::AllReduce),
    Kind::Op(OpKind::Broadcast),
    Kind::Op(OpKind::Reduce),
    Kind::Op(OpKind::Barrier),
    Kind::NewStream,
    Kind::NewGroup,
];

const DTYPES: [DType; 11] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
    DType::F6E2M3,
];

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// Names of buffers in [`Problem`]s (the thread backend's `which` strings).
const WHICH: [&str; 3] = ["input", "output", "buffer"];

fn index_of<T: PartialEq>(table: &[T], x: &T) -> u8 {
    table
        .iter()
        .position(|t| t == x)
        .unwrap_or(u8::MAX as usize) as u8
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
            None => self.u8(0),
        }
    }
    fn buf(&mut self, b: Option<RawBuf>) {
        match b {
            Some(b) => {
                self.u8(1);
                self.u64(b.len as u64);
                self.u8(index_of(&DTYPES, &b.dtype));
            }
            None => self.u8(0),
        }
    }
}

/// A device location as one integer: 0 the CPU, odd a GPU, even a Metal device.
fn location_code(l: DeviceLocation) -> u64 {
    match l {
        DeviceLocation::Cpu => 0,
        DeviceLocation::Cuda { gpu_id } => 1 + 2 * gpu_id as u64,
        DeviceLocation::Metal { gpu_id } => 2 + 2 * gpu_id as u64,
    }
}

/// The inverse of [`location_code`].
fn location_of(code: u64) -> DeviceLocation {
    match code {
        0 => DeviceLocation::Cpu,
        c if c % 2 == 1 => DeviceLocation::Cuda {
            gpu_id: ((c - 1) / 2) as usize,
        },
        c => DeviceLocation::Metal {
            gpu_id: ((c - 2) / 2) as usize,
        },
    }
}

/// Encodes `post` (its setup argument bytes included); the buffers' addresses are not sent.
pub(crate) fn encode(post: &Post, setup_bytes: &[u8]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + setup_bytes.len()));
    w.u8(index_of(&KINDS, &post.kind));
    w.u64(post.seq);
    w.buf(post.input);
    w.buf(post.output);
    match post.op {
        Some(op) => {
            w.u8(1);
            w.u8(index_of(&OPS, &op));
        }
        None => w.u8(0),
    }
    w.opt_u64(post.root.map(|r| r as u64));
    w.opt_u64(post.index.map(|i| i as u64));
    match post.problem {
        None => w.u8(0),
        Some(Problem::NotOnCpu { which, found }) => {
            w.u8(1);
            w.u8(index_of(&WHICH, &which));
            w.u64(location_code(found));
        }
        Some(Problem::NotOneD { which, dims }) => {
            w.u8(2);
            w.u8(index_of(&WHICH, &which));
            w.u64(dims as u64);
        }
        Some(Problem::NotContiguous { which }) => {
            w.u8(3);
            w.u8(index_of(&WHICH, &which));
        }
        Some(Problem::Dtype { which, dtype }) => {
            w.u8(4);
            w.u8(index_of(&WHICH, &which));
            w.u8(index_of(&DTYPES, &dtype));
        }
        Some(Problem::Aliased) => w.u8(5),
        // Device backends' problem (the MPI backend is CPU-only; encoded for completeness).
        Some(Problem::WrongDevice {
            which,
            expected,
            found,
            other_device,
        }) => {
            w.u8(6);
            w.u8(index_of(&WHICH, &which));
            w.u64(location_code(expected));
            w.u64(location_code(found));
            w.u8(u8::from(other_device));
        }
    }
    match post.bytes {
        Some(_) => {
            w.u8(1);
            w.u64(setup_bytes.len() as u64);
            w.0.extend_from_slice(setup_bytes);
        }
        None => w.u8(0),
    }
    w.0
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }
    fn flag(&mut self) -> Option<bool> {
        self.u8().map(|f| f != 0)
    }
    fn opt_u64(&mut self) -> Option<Option<u64>> {
        if self.flag()? {
            self.u64().map(Some)
        } else {
            Some(None)
        }
    }
    fn buf(&mut self) -> Option<Option<RawBuf>> {
        if !self.flag()? {
            return Some(None);
        }
        let len = self.u64()? as usize;
        let dtype = *DTYPES.get(self.u8()? as usize)?;
        Some(Some(RawBuf {
            ptr: std::ptr::null_mut(),
            len,
            dtype,
        }))
    }
    fn which(&mut self) -> Option<&'static str> {
        WHICH.get(self.u8()? as usize).copied()
    }
}

/// Decodes a peer's descriptor; the setup argument, if any, points into `bytes` (which must
/// outlive the post's use). `None` when the bytes are not a descriptor of this version.
pub(crate) fn decode(bytes: &[u8]) -> Option<Post> {
    let mut r = Reader { bytes, at: 0 };
    let kind = *KINDS.get(r.u8()? as usize)?;
    let mut post = Post::new(kind, r.u64()?);
    post.input = r.buf()?;
    post.output = r.buf()?;
    post.op = if r.flag()? {
        Some(*OPS.get(r.u8()? as usize)?)
    } else {
        None
    };
    post.root = r.opt_u64()?.map(|v| v as usize);
    post.index = r.opt_u64()?.map(|v| v as usize);
    post.problem = match r.u8()? {
        0 => None,
        1 => {
            let which = r.which()?;
            let found = location_of(r.u64()?);
            Some(Problem::NotOnCpu { which, found })
        }
        2 => Some(Problem::NotOneD {
            which: r.which()?,
            dims: r.u64()? as usize,
        }),
        3 => Some(Problem::NotContiguous { which: r.which()? }),
        4 => Some(Problem::Dtype {
            which: r.which()?,
            dtype: *DTYPES.get(r.u8()? as usize)?,
        }),
        5 => Some(Problem::Aliased),
        6 => Some(Problem::WrongDevice {
            which: r.which()?,
            expected: location_of(r.u64()?),
            found: location_of(r.u64()?),
            other_device: r.flag()?,
        }),
        _ => return None,
    };
    post.bytes = if r.flag()? {
        let n = r.u64()? as usize;
        Some(RawBytes::of(r.take(n)?))
    } else {
        None
    };
    Some(post)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip() {
        let mut p = Post::new(Kind::Op(OpKind::ReduceScatter), 42);
        p.input = Some(RawBuf {
            ptr: std::ptr::null_mut(),
            len: 1000,
            dtype: DType::BF16,
        });
        p.output = Some(RawBuf {
            ptr: std::ptr::null_mut(),
            len: 500,
            dtype: DType::BF16,
        });
        p.op = Some(ReduceOp::Avg);
        p.problem = Some(Problem::NotOneD {
            which: "output",
            dims: 3,
        });
        let bytes = encode(&p, &[]);
        assert!(bytes.len() <= OP_DESC_MAX);
        let q = decode(&bytes).unwrap();
        assert_eq!(q.kind, p.kind);
        assert_eq!(q.seq, 42);
        assert_eq!(q.input.unwrap().len, 1000);
        assert_eq!(q.output.unwrap().dtype, DType::BF16);
        assert_eq!(q.op, Some(ReduceOp::Avg));
        assert_eq!(q.problem, p.problem);
        assert!(q.bytes.is_none());
        p.problem = Some(Problem::WrongDevice {
            which: "input",
            expected: DeviceLocation::Cuda { gpu_id: 3 },
            found: DeviceLocation::Cpu,
            other_device: true,
        });
        assert_eq!(decode(&encode(&p, &[])).unwrap().problem, p.problem);

        let mut s = Post::new(Kind::NewStream, 3);
        s.index = Some(2);
        s.bytes = Some(RawBytes::of(b"all_gather"));
        let bytes = encode(&s, b"all_gather");
        let t = decode(&bytes).unwrap();
        assert_eq!(t.index, Some(2));
        assert_eq!(t.kind, Kind::NewStream);
        assert!(decode(&bytes[..bytes.len() - 1]).is_none(), "truncated");
    }
}
