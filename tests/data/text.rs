//! Text corpora split on a character boundary (issue 30): a file whose 95 % point falls inside a
//! multi-byte UTF-8 character gives a training and a validation split that are each UTF-8 and
//! join to the file, as bytes ([`TextCorpus`]) and as a tokenizer's ids ([`TokenCorpus`]: the
//! whole file tokenized, the ids split).

use candle_fsdp::data::text::{Split, TextCorpus, TokenCorpus, DEFAULT_VAL_FRACTION};

/// 94 ASCII bytes, "€" (3 bytes) at bytes 94–96, then 3 ASCII bytes: 100 bytes, whose last 5 %
/// start at byte 95, inside the "€".
fn euro_text() -> String {
    let t = format!("{}€bbb", "a".repeat(94));
    assert_eq!(t.len(), 100);
    let naive = t.len() - (t.len() as f64 * DEFAULT_VAL_FRACTION).round() as usize;
    assert_eq!(naive, 95);
    assert!(
        !t.is_char_boundary(naive),
        "the 95 % point is inside a character"
    );
    t
}

#[test]
fn byte_corpus_splits_on_a_character_boundary() {
    let text = euro_text();
    let dir = std::env::temp_dir().join(format!("candle-fsdp-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("euro.txt");
    std::fs::write(&path, &text).unwrap();
    let c = TextCorpus::load(&path).unwrap();
    let train = std::str::from_utf8(c.split(Split::Train)).expect("the training split is UTF-8");
    let val = std::str::from_utf8(c.split(Split::Val)).expect("the validation split is UTF-8");
    assert_eq!(train, "a".repeat(94));
    assert_eq!(val, "€bbb", "the character goes to the validation split");
    assert_eq!(format!("{train}{val}"), text);
    assert_eq!(c.text().unwrap(), text);
    // An ASCII corpus splits where it always did: the last round(5 %) of the bytes.
    let ascii = TextCorpus::from_bytes("ascii", vec![b'x'; 100], DEFAULT_VAL_FRACTION).unwrap();
    assert_eq!(ascii.split(Split::Val).len(), 5);
    // Bytes that are not UTF-8 there split at the byte offset (a byte corpus is bytes).
    let mut raw = vec![b'x'; 100];
    raw[95] = 0x80;
    raw[94] = 0x80;
    let c = TextCorpus::from_bytes("raw", raw, DEFAULT_VAL_FRACTION).unwrap();
    assert_eq!(c.split(Split::Val).len(), 5);
    let e = c.text().unwrap_err().to_string();
    assert!(
        e.contains("raw") && e.contains("not UTF-8") && e.contains("byte 94"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A character-level tokenizer: each character's code point is its id.
fn chars(text: &str) -> Result<Vec<u32>, String> {
    Ok(text.chars().map(|c| c as u32).collect())
}

fn decode(ids: &[u32]) -> String {
    ids.iter().map(|&i| char::from_u32(i).unwrap()).collect()
}

#[test]
fn tokenized_corpus_tokenizes_the_whole_file_then_splits_the_ids() {
    // Many multi-byte characters, one of them across the byte 95 % point.
    let text = euro_text();
    let c = TextCorpus::from_bytes("euro.txt", text.clone().into_bytes(), DEFAULT_VAL_FRACTION)
        .unwrap();
    let t = TokenCorpus::tokenize(&c, DEFAULT_VAL_FRACTION, chars).unwrap();
    assert_eq!(decode(t.tokens()), text, "the ids are the file's text");
    let (train, val) = (t.split(Split::Train), t.split(Split::Val));
    assert!(
        !train.contains(&0xFFFD) && !val.contains(&0xFFFD),
        "no replacement character"
    );
    assert_eq!(format!("{}{}", decode(train), decode(val)), text);
    // The last round(5 %) of the 98 ids.
    assert_eq!(val.len(), 5);
    assert_eq!(decode(val), "a€bbb");
    // Windows come from inside a split.
    let (x, y) = t
        .windows(Split::Val, 3, 4, 0, 0, 0, &candle_core::Device::Cpu)
        .unwrap();
    let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
    for (xr, yr) in x.iter().zip(&y) {
        assert_eq!(&xr[1..], &yr[..3]);
        assert!(decode(val).contains(&decode(xr)));
    }
    // A longer mixed text: every split boundary keeps the text whole.
    let long: String = "Où est le café? Ça coûte 3 € — “très cher”. ".repeat(40);
    let c = TextCorpus::from_bytes("long.txt", long.clone().into_bytes(), 0.05).unwrap();
    let t = TokenCorpus::tokenize(&c, 0.05, chars).unwrap();
    assert_eq!(
        format!(
            "{}{}",
            decode(t.split(Split::Train)),
            decode(t.split(Split::Val))
        ),
        long
    );
    // A file that is not UTF-8 is refused, naming it and the byte offset.
    let mut bad = text.into_bytes();
    bad[10] = 0xFF;
    let c = TextCorpus::from_bytes("bad.txt", bad, DEFAULT_VAL_FRACTION).unwrap();
    let e = TokenCorpus::tokenize(&c, DEFAULT_VAL_FRACTION, chars)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.txt") && e.contains("byte 10"), "{e}");
    // The tokenizer's own error is named with the file.
    let c = TextCorpus::from_bytes("tok.txt", b"hello".to_vec(), 0.5).unwrap();
    let e = TokenCorpus::tokenize(&c, 0.5, |_: &str| Err::<Vec<u32>, _>("no vocabulary"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tok.txt") && e.contains("no vocabulary"), "{e}");
}
