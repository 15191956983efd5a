//! FlatParameter layout and sharding: alignment, padding, the shard table, and the edge cases
//! (numel not divisible by world size, a unit without parameters, world size above numel).

use candle_core::Shape;
use candle_fsdp::flat_param::{FlatParamLayout, FlatParameter, ALIGN_ELEMS};

fn layout(shapes: &[&[usize]], ws: usize) -> FlatParamLayout {
    let params: Vec<(String, Shape)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("p{i}"), Shape::from(s.to_vec())))
        .collect();
    FlatParamLayout::new(&params, ws).unwrap()
}

/// Every element of every parameter appears in exactly one rank's shard table, at the flat
/// position the layout gives it.
fn assert_covers_once(l: &FlatParamLayout) {
    let mut seen: Vec<Vec<u32>> = l.params.iter().map(|p| vec![0; p.numel]).collect();
    for r in 0..l.world_size {
        let shard = l.shard_range(r);
        assert_eq!(shard.len(), l.shard_numel);
        for e in l.shard_table(r) {
            let p = &l.params[e.param_index];
            assert_eq!(e.range_in_param.len(), e.numel_in_shard);
            // Flat position of the first element matches the shard offset.
            assert_eq!(
                p.offset + e.range_in_param.start,
                shard.start + e.offset_in_shard
            );
            for i in e.range_in_param.clone() {
                seen[e.param_index][i] += 1;
            }
        }
    }
    for (p, s) in l.params.iter().zip(&seen) {
        assert!(s.iter().all(|&c| c == 1), "{}: coverage {:?}", p.name, s);
    }
}

#[test]
fn offsets_are_aligned_and_padding_divides_world_size() {
    // 13*20 = 260, bias 13 → 260..273, then a 3-vector at 276 (aligned), ends at 279.
    let l = layout(&[&[13, 20], &[13], &[3]], 4);
    let offsets: Vec<usize> = l.params.iter().map(|p| p.offset).collect();
    assert_eq!(offsets, vec![0, 260, 276]);
    assert!(offsets.iter().all(|o| o % ALIGN_ELEMS == 0));
    assert_eq!(l.unpadded_numel, 279);
    assert_eq!(l.padded_numel, 280);
    assert_eq!(l.shard_numel, 70);
    assert_eq!(l.param_numel(), 260 + 13 + 3);
    assert_covers_once(&l);
}

#[test]
fn numel_not_divisible_by_world_size() {
    for ws in 1..=7 {
        let l = layout(&[&[5, 7], &[5]], ws);
        assert_eq!(l.padded_numel % ws, 0);
        assert!(l.padded_numel >= l.unpadded_numel && l.padded_numel < l.unpadded_numel + ws);
        assert_covers_once(&l);
    }
}

#[test]
fn unit_without_parameters() {
    let l = layout(&[], 3);
    assert_eq!((l.padded_numel, l.shard_numel), (0, 0));
    assert!(l.shard_table(2).is_empty());
    let f = FlatParameter::from_fn(l, 2, |_, _, _| unreachable!("nothing to fill")).unwrap();
    assert!(f.shard.is_empty());
}

#[test]
fn world_size_larger_than_numel() {
    let l = layout(&[&[1], &[1]], 8);
    // p0 at 0, p1 at 4 (aligned) → 5 elements → padded to 8, one per rank.
    assert_eq!((l.unpadded_numel, l.padded_numel, l.shard_numel), (5, 8, 1));
    assert_eq!(l.shard_table(0).len(), 1);
    assert!(l.shard_table(1).is_empty() && l.shard_table(7).is_empty());
    assert_eq!(l.shard_table(4)[0].param_index, 1);
    assert_covers_once(&l);
}

#[test]
fn shards_hold_the_right_values_and_zero_padding() {
    let l = layout(&[&[3, 3], &[2]], 3);
    // p0 = 0..9 at offset 0, p1 = 100,101 at offset 12 → 14 → padded 15, shards of 5.
    let values = [
        (0..9).map(|v| v as f32).collect::<Vec<_>>(),
        vec![100.0, 101.0],
    ];
    let mut flat = Vec::new();
    for r in 0..3 {
        let f = FlatParameter::from_fn(l.clone(), r, |i, range, out| {
            out.copy_from_slice(&values[i][range]);
            Ok(())
        })
        .unwrap();
        flat.extend(f.shard);
    }
    let mut expected = vec![0.0f32; 15];
    expected[..9].copy_from_slice(&values[0]);
    expected[12..14].copy_from_slice(&values[1]);
    assert_eq!(flat, expected);
}

#[test]
fn errors_name_the_problem() {
    let e = FlatParamLayout::new(&[("w".into(), Shape::from(3))], 0).unwrap_err();
    assert!(e.to_string().contains("world size"), "{e}");
    let e = FlatParamLayout::new(
        &[("w".into(), Shape::from(3)), ("w".into(), Shape::from(2))],
        2,
    )
    .unwrap_err();
    assert!(e.to_string().contains("w is registered twice"), "{e}");
}
