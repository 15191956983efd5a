//! The store's wire format: requests, replies and their length-prefixed frames.

use super::*;

// ---------------------------------------------------------------------------------------------
// Wire format
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Request {
    Hello {
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

#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Body encoder.
pub(super) struct Enc(Vec<u8>);

impl Enc {
    fn new(opcode: u8) -> Enc {
        Enc(vec![opcode])
    }
    fn u32(mut self, v: u32) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Enc {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Enc {
        let mut e = self.u32(b.len() as u32);
        e.0.extend_from_slice(b);
        e
    }
    fn ranks(self, r: &[u32]) -> Enc {
        r.iter().fold(self.u32(r.len() as u32), |e, &v| e.u32(v))
    }
}

/// Body decoder; every read checks the remaining length.
pub(super) struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "truncated message: {n} more bytes expected, {} left",
                self.0.len()
            ));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn bytes(&mut self, max: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(format!(
                "{what} of {n} bytes exceeds the limit of {max} bytes"
            ));
        }
        self.take(n)
    }
    fn string(&mut self, max: usize, what: &str) -> std::result::Result<String, String> {
        let b = self.bytes(max, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
    fn ranks(&mut self) -> std::result::Result<Vec<u32>, String> {
        let n = self.u32()? as usize;
        if n > self.0.len() / 4 {
            return Err(format!("rank list of {n} entries exceeds the message"));
        }
        (0..n).map(|_| self.u32()).collect()
    }
    fn end(&self) -> std::result::Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected trailing bytes", self.0.len()))
        }
    }
}

impl Request {
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello {
                rank,
                world_size,
                job,
            } => {
                let mut e = Enc::new(op::HELLO);
                e.0.extend_from_slice(MAGIC);
                e.u32(*rank).u32(*world_size).bytes(job.as_bytes()).0
            }
            Request::Set { key, value } => Enc::new(op::SET).bytes(key.as_bytes()).bytes(value).0,
            Request::Get { key, wait_ms } => {
                Enc::new(op::GET).bytes(key.as_bytes()).u32(*wait_ms).0
            }
            Request::Joined { wait_ms } => Enc::new(op::JOINED).u32(*wait_ms).0,
            Request::Barrier {
                name,
                generation,
                wait_ms,
            } => {
                Enc::new(op::BARRIER)
                    .bytes(name.as_bytes())
                    .u64(*generation)
                    .u32(*wait_ms)
                    .0
            }
        }
    }

    pub(super) fn decode(body: &[u8]) -> std::result::Result<Request, String> {
        let mut d = Dec(body);
        let req = match d.u8()? {
            op::HELLO => {
                if d.take(MAGIC.len())? != MAGIC {
                    return Err("not a candle-fsdp store client (bad magic)".into());
                }
                Request::Hello {
                    rank: d.u32()?,
                    world_size: d.u32()?,
                    job: d.string(MAX_KEY_BYTES, "job")?,
                }
            }
            op::SET => Request::Set {
                key: d.string(MAX_KEY_BYTES, "key")?,
                value: d.bytes(MAX_VALUE_BYTES, "value")?.to_vec(),
            },
            op::GET => Request::Get {
                key: d.string(MAX_KEY_BYTES, "key")?,
                wait_ms: d.u32()?,
            },
            op::JOINED => Request::Joined { wait_ms: d.u32()? },
            op::BARRIER => Request::Barrier {
                name: d.string(MAX_KEY_BYTES, "barrier name")?,
                generation: d.u64()?,
                wait_ms: d.u32()?,
            },
            other => return Err(format!("unknown request opcode {other:#04x}")),
        };
        d.end()?;
        Ok(req)
    }
}

impl Reply {
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Ok => vec![op::OK],
            Reply::Value(v) => Enc::new(op::VALUE).bytes(v).0,
            Reply::NotYet => vec![op::NOT_YET],
            Reply::Done => vec![op::DONE],
            Reply::Pending {
                missing,
                left,
                notes,
            } => {
                notes
                    .iter()
                    .fold(
                        Enc::new(op::PENDING)
                            .ranks(missing)
                            .ranks(left)
                            .u32(notes.len() as u32),
                        |e, n| e.bytes(n.as_bytes()),
                    )
                    .0
            }
            Reply::Err(m) => Enc::new(op::ERR).bytes(m.as_bytes()).0,
        }
    }

    pub(super) fn decode(body: &[u8]) -> std::result::Result<Reply, String> {
        let mut d = Dec(body);
        let reply = match d.u8()? {
            op::OK => Reply::Ok,
            op::VALUE => Reply::Value(d.bytes(MAX_VALUE_BYTES, "value")?.to_vec()),
            op::NOT_YET => Reply::NotYet,
            op::DONE => Reply::Done,
            op::PENDING => {
                let missing = d.ranks()?;
                let left = d.ranks()?;
                let n = d.u32()? as usize;
                if n > MAX_NOTES {
                    return Err(format!("{n} notes exceed the limit of {MAX_NOTES}"));
                }
                let notes = (0..n)
                    .map(|_| d.string(MAX_KEY_BYTES * 4, "note"))
                    .collect::<std::result::Result<_, _>>()?;
                Reply::Pending {
                    missing,
                    left,
                    notes,
                }
            }
            op::ERR => {
                Reply::Err(String::from_utf8_lossy(d.bytes(MAX_FRAME_BYTES, "error")?).into())
            }
            other => return Err(format!("unknown reply opcode {other:#04x}")),
        };
        d.end()?;
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
