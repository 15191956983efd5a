//! The descriptor of a collective (MPI: sent to every peer; TCP: in each rank's descriptor
//! frame; shared memory: written to the rank's segment header) before data moves: its [`Post`]
//! (kind, sequence number, buffer lengths and dtypes, reduce op, root, setup argument, stream
//! index, local problem; serde derives in `buffer.rs`) in postcard's format: a small
//! self-delimiting byte string (varints, a one-byte tag for each option and variant, dtypes and
//! buffer names as text, a length before the setup argument's bytes; bytes after it are
//! ignored, so a descriptor may be read from a longer zero-filled buffer). Postcard: serde
//! derives instead of a hand-written codec, a documented format that is stable across its 1.x
//! versions, and varints that keep a collective's descriptor within [`OP_DESC_MAX`]. Every rank
//! decodes all of them and runs the same [`crate::comm::buffer::validate`] as the thread backend,
//! so a mismatch is the same error on every rank instead of a hang or garbage.

use candle_core::{DType, DeviceLocation};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::comm::buffer::{Post, Problem, Which};

/// Largest descriptor of a collective (bytes); setup descriptors carry their argument too. A
/// collective's is at most 105 bytes (every field there, every number at its largest: tested).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) const OP_DESC_MAX: usize = 128;

/// Names of buffers in [`crate::comm::buffer::Problem`]s (the thread backend's `which`).
const WHICH: [Which; 3] = ["input", "output", "buffer"];

/// Candle's [`DeviceLocation`] for serde (`#[serde(with = "wire::Location")]`).
#[derive(Serialize, Deserialize)]
#[serde(remote = "DeviceLocation")]
pub(crate) enum Location {
    Cpu,
    Cuda { gpu_id: usize },
    Metal { gpu_id: usize },
}

/// Candle's [`DType`] for serde (`#[serde(with = "wire::dtype")]`): its name (`bf16`, …),
/// candle's `as_str` and `FromStr`, which cover every dtype.
pub(crate) mod dtype {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        d.as_str().serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        <&str>::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

/// A decoded buffer name as the `&'static str` of [`WHICH`] (it is sent as text).
pub(crate) fn which<'de, D: Deserializer<'de>>(d: D) -> Result<Which, D::Error> {
    let name = <&str>::deserialize(d)?;
    WHICH
        .into_iter()
        .find(|w| *w == name)
        .ok_or_else(|| D::Error::custom(format!("unknown buffer {name:?}")))
}

/// Encodes `post` (the buffers' addresses are not sent).
pub(crate) fn encode(post: &Post) -> Vec<u8> {
    let out = Vec::with_capacity(OP_DESC_MAX + post.bytes.as_ref().map_or(0, Vec::len));
    postcard::to_extend(post, out).expect("descriptors serialize")
}

/// [`encode`], or, when the setup argument makes the descriptor longer than `max` bytes (the
/// backend's limit), the encoding of a post that reports it instead ([`Problem::TooLong`]): every
/// rank's validation then refuses the operation with the same error naming the sizes, nobody
/// waits for bytes that were never sent, and the group stays usable.
pub(crate) fn encode_within(post: &Post, max: usize) -> Vec<u8> {
    let desc = encode(post);
    if desc.len() <= max {
        return desc;
    }
    let mut short = Post::new(post.kind, post.seq);
    short.problem = Some(Problem::TooLong {
        arg: post.bytes.as_ref().map_or(0, Vec::len),
        found: desc.len(),
        max,
    });
    encode(&short)
}

/// Decodes a peer's descriptor; `None` when the bytes are not a descriptor. (Descriptors carry
/// no version: the order of the variants of `Kind`, `OpKind`, `ReduceOp` and `Problem` is their
/// format, so ranks must run one build, which `fsdp-run` and the store's protocol check
/// ensure for the process backends.)
pub(crate) fn decode(bytes: &[u8]) -> Option<Post> {
    postcard::from_bytes(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::buffer::{Kind, Problem, RawBuf};
    use crate::comm::{OpKind, ReduceOp};

    #[test]
    fn descriptors_round_trip() {
        let mut p = Post::new(Kind::Op(OpKind::ReduceScatter), 42);
        p.input = Some(RawBuf {
            ptr: std::ptr::null_mut(),
            len: 1000,
            dtype: DType::BF16,
        });
        p.output = p.input.map(|input| RawBuf { len: 500, ..input });
        p.op = Some(ReduceOp::Avg);
        p.problem = Some(Problem::NotOneD {
            which: "output",
            dims: 3,
        });
        let bytes = encode(&p);
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
        assert_eq!(decode(&encode(&p)).unwrap().problem, p.problem);

        let mut s = Post::new(Kind::NewStream, 3);
        s.index = Some(2);
        s.bytes = Some(b"all_gather".to_vec());
        let bytes = encode(&s);
        // Postcard's option tag, length and bytes: as long as when the argument followed the
        // post instead of being one of its fields.
        let without = Post {
            bytes: None,
            ..s.clone()
        };
        assert_eq!(bytes.len(), encode(&without).len() + 1 + 10);
        assert_eq!(encode_within(&s, bytes.len()), bytes);
        let short = decode(&encode_within(&s, bytes.len() - 1)).unwrap();
        assert_eq!(
            (short.kind, short.seq, short.bytes),
            (Kind::NewStream, 3, None)
        );
        let (arg, found, max) = (10, bytes.len(), bytes.len() - 1);
        assert_eq!(short.problem, Some(Problem::TooLong { arg, found, max }));
        let t = decode(&bytes).unwrap();
        assert_eq!(t.index, Some(2));
        assert_eq!(t.bytes.as_deref(), Some(&b"all_gather"[..]));
        assert_eq!(t.kind, Kind::NewStream);
        assert!(decode(&bytes[..bytes.len() - 1]).is_none(), "truncated");
        let mut padded = bytes.clone();
        padded.resize(OP_DESC_MAX, 0);
        assert_eq!(
            decode(&padded).unwrap().kind,
            Kind::NewStream,
            "zeros after it"
        );
        assert!(decode(&[0xff; 16]).is_none(), "garbage");
        let mut bad_dtype = encode(&p);
        let at = bad_dtype.windows(4).position(|w| w == b"bf16").unwrap();
        bad_dtype[at] = b'x';
        assert!(decode(&bad_dtype).is_none(), "unknown dtype");
    }

    /// Every field there, every number at its largest, the longest dtype and buffer names.
    #[test]
    fn the_largest_descriptor_fits() {
        let buf = Some(RawBuf {
            ptr: std::ptr::null_mut(),
            len: usize::MAX,
            dtype: DType::F8E4M3,
        });
        let gpu = DeviceLocation::Cuda { gpu_id: usize::MAX };
        let mut p = Post::new(Kind::Op(OpKind::ReduceScatter), u64::MAX);
        (p.input, p.output, p.op) = (buf, buf, Some(ReduceOp::Min));
        (p.root, p.index) = (Some(usize::MAX), Some(usize::MAX));
        p.problem = Some(Problem::WrongDevice {
            which: "output",
            expected: gpu,
            found: gpu,
            other_device: true,
        });
        let bytes = encode(&p);
        assert_eq!(bytes.len(), 105);
        assert!(bytes.len() <= OP_DESC_MAX);
        let q = decode(&bytes).unwrap();
        assert_eq!((q.seq, q.root, q.index), (p.seq, p.root, p.index));
        assert_eq!(q.problem, p.problem);
    }
}
