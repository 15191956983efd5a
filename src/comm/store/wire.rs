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
        #[serde(with = "serde_bytes")]
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
    Value(#[serde(with = "serde_bytes")] Vec<u8>),
    NotYet,
    Done,
    Pending {
        missing: Vec<u32>,
        left: Vec<u32>,
        /// The registrations the server refused, `"; "`-separated.
        notes: String,
    },
    Err(String),
}

/// The protocol a peer of another build speaks, from the first bytes of its HELLO (every
/// version's: an opcode byte, then `CFSDPKV` and the version), when it is not [`MAGIC`].
fn other_version(body: &[u8]) -> Option<String> {
    let magic = body.get(1..9)?;
    (magic.starts_with(b"CFSDPKV") && magic != MAGIC)
        .then(|| String::from_utf8_lossy(magic).into_owned())
}

/// The body of a message (postcard cannot fail on these types: no custom serializers, every
/// sequence's length known).
pub(super) fn encode(msg: &impl Serialize) -> Vec<u8> {
    postcard::to_allocvec(msg).expect("store messages serialize")
}

/// The message of a body: exactly one, whole; the error names what was wrong. `variants`:
/// how many the message type has.
fn decode<'a, T: Deserialize<'a>>(
    body: &'a [u8],
    what: &str,
    variants: u8,
) -> std::result::Result<T, String> {
    match postcard::take_from_bytes(body) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(format!(
            "{what} of {} bytes with {} unexpected trailing bytes",
            body.len(),
            rest.len()
        )),
        Err(postcard::Error::DeserializeUnexpectedEnd) => Err(format!(
            "truncated {what} ({} bytes, opcode {:#04x})",
            body.len(),
            body[0]
        )),
        // Serde's error on these types (postcard keeps no text): an unknown variant index,
        // which the body's first byte holds (the first of several from 0x80 on: a varint).
        Err(postcard::Error::SerdeDeCustom) if body[0] >= variants => {
            Err(format!("unknown {what} opcode {:#04x}", body[0]))
        }
        Err(e) => Err(format!("malformed {what} (opcode {:#04x}): {e}", body[0])),
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
    /// A body that is no request of this version, or a `Hello` of another magic, is named as
    /// another version's when it starts as one (never a well-formed request that only looks
    /// like one, such as a key of 67 bytes starting `FSDPKV`).
    pub(super) fn decode(body: &[u8]) -> std::result::Result<Request, String> {
        let req = decode(body, "request", 5).and_then(|req| match &req {
            Request::Hello { magic, .. } if magic != MAGIC => {
                Err("not a candle-fsdp store client (bad magic)".into())
            }
            _ => Ok(req),
        });
        let req = req.map_err(|e| match other_version(body) {
            Some(theirs) => format!(
                "a client speaking store protocol {theirs}, this server {}: the launcher and \
                 the ranks must come from one candle-fsdp build",
                String::from_utf8_lossy(MAGIC)
            ),
            None => e,
        })?;
        match &req {
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
        // Protocol CFSDPKV2 and earlier: an error reply's opcode (0xFF, then the text after a
        // 4-byte length), which is how such a server answers this build's HELLO.
        if body.first() == Some(&0xFF) {
            return Err(format!(
                "the store server speaks an older protocol than this client ({}): the launcher \
                 and the ranks must come from one candle-fsdp build (it said: {})",
                String::from_utf8_lossy(MAGIC),
                String::from_utf8_lossy(body.get(5..).unwrap_or_default())
            ));
        }
        let reply = decode(body, "reply", 6)?;
        match &reply {
            Reply::Value(v) => limit("value", v.len(), MAX_VALUE_BYTES)?,
            Reply::Pending { notes, .. } => limit("notes", notes.len(), MAX_NOTES_BYTES)?,
            Reply::Ok | Reply::NotYet | Reply::Done | Reply::Err(_) => {}
        }
        Ok(reply)
    }
}

pub(super) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    debug_assert!(!body.is_empty() && body.len() <= MAX_FRAME_BYTES);
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

/// A frame's body; an announced length of 0 or over [`MAX_FRAME_BYTES`] is
/// [`io::ErrorKind::InvalidData`] (naming it), any other error the socket's (`UnexpectedEof`
/// for a clean close).
pub(super) fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let n = u32::from_be_bytes(len);
    if n == 0 || n as usize > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes refused: lengths are 1..={MAX_FRAME_BYTES} bytes"),
        ));
    }
    let mut body = vec![0u8; n as usize];
    r.read_exact(&mut body)?;
    Ok(body)
}
