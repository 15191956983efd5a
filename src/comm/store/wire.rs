//! The store's wire format: requests, replies (serde derives, postcard bodies) and their
//! length-prefixed frames.

use serde::{Deserialize, Serialize};

use super::*;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Request {
    Hello {
        /// [`MAGIC`]: the protocol and its version.
        magic: [u8; 8],
        rank: u32,
        world_size: u32,
        /// The job the rank belongs to (`TORCHELASTIC_RUN_ID`; empty when unset).
        job: String,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        wait_ms: u32,
    },
    Joined {
        wait_ms: u32,
    },
    Barrier {
        name: String,
        generation: u64,
        wait_ms: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Reply {
    Ok,
    Value(Vec<u8>),
    NotYet,
    Done,
    Pending {
        missing: Vec<u32>,
        left: Vec<u32>,
        notes: Vec<String>,
    },
    Err(String),
}

/// The body of a message (postcard cannot fail on these types: no custom serializers, every
/// sequence's length known).
pub(super) fn encode(msg: &impl Serialize) -> Vec<u8> {
    postcard::to_allocvec(msg).expect("store messages serialize")
}

/// The message of a body: exactly one, whole; the error names what was wrong.
fn decode<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> std::result::Result<T, String> {
    match postcard::take_from_bytes(body) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(format!("{} unexpected trailing bytes", rest.len())),
        Err(postcard::Error::DeserializeUnexpectedEnd) => Err("truncated message".into()),
        // Serde's only error on these types (postcard keeps no text): an unknown variant index,
        // which the body's first byte holds (the first of several from 0x80 on: a varint).
        Err(postcard::Error::SerdeDeCustom) => {
            Err(format!("unknown {what} opcode {:#04x}", body[0]))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `Err` when `what` holds `n > max` bytes.
fn limit(what: &str, n: usize, max: usize) -> std::result::Result<(), String> {
    if n > max {
        return Err(format!(
            "{what} of {n} bytes exceeds the limit of {max} bytes"
        ));
    }
    Ok(())
}

impl Request {
    pub(super) fn decode(body: &[u8]) -> std::result::Result<Request, String> {
        let req = decode(body, "request")?;
        match &req {
            Request::Hello { magic, .. } if magic != MAGIC => {
                return Err("not a candle-fsdp store client (bad magic)".into())
            }
            Request::Hello { job, .. } => limit("job", job.len(), MAX_KEY_BYTES)?,
            Request::Set { key, value } => {
                limit("key", key.len(), MAX_KEY_BYTES)?;
                limit("value", value.len(), MAX_VALUE_BYTES)?;
            }
            Request::Get { key, .. } => limit("key", key.len(), MAX_KEY_BYTES)?,
            Request::Joined { .. } => {}
            Request::Barrier { name, .. } => limit("barrier name", name.len(), MAX_KEY_BYTES)?,
        }
        Ok(req)
    }
}

impl Reply {
    pub(super) fn decode(body: &[u8]) -> std::result::Result<Reply, String> {
        let reply = decode(body, "reply")?;
        match &reply {
            Reply::Value(v) => limit("value", v.len(), MAX_VALUE_BYTES)?,
            Reply::Pending { notes, .. } if notes.len() > MAX_NOTES => {
                return Err(format!(
                    "{} notes exceed the limit of {MAX_NOTES}",
                    notes.len()
                ))
            }
            Reply::Pending { notes, .. } => {
                for n in notes {
                    limit("note", n.len(), MAX_KEY_BYTES * 4)?;
                }
            }
            Reply::Ok | Reply::NotYet | Reply::Done | Reply::Err(_) => {}
        }
        Ok(reply)
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(super) enum FrameError {
    /// The socket failed or closed (`UnexpectedEof` for a clean close).
    Io(io::Error),
    /// The announced length is 0 or over [`MAX_FRAME_BYTES`].
    BadLength(u32),
}

pub(super) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    debug_assert!(!body.is_empty() && body.len() <= MAX_FRAME_BYTES);
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

pub(super) fn read_frame(r: &mut impl Read) -> std::result::Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(FrameError::Io)?;
    let n = u32::from_be_bytes(len);
    if n == 0 || n as usize > MAX_FRAME_BYTES {
        return Err(FrameError::BadLength(n));
    }
    let mut body = vec![0u8; n as usize];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    Ok(body)
}
