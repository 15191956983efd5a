//! FlatParameter layout and sharding: alignment, padding, the shard table, and the edge cases
//! (numel not divisible by world size, a unit without parameters, world size above numel); the
//! device-resident shard and gradient: accumulation in place, setters that check what they get.

use candle_core::{DType, Device, Shape, Tensor};
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
    let f = FlatParameter::from_fn(l, 2, &Device::Cpu, |_, _, _| {
        unreachable!("nothing to fill")
    })
    .unwrap();
    assert_eq!(f.shard().dims(), [0]);
    assert_eq!(f.sharded_bytes(), 0);
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
        let f = FlatParameter::from_fn(l.clone(), r, &Device::Cpu, |i, range, out| {
            out.copy_from_slice(&values[i][range]);
            Ok(())
        })
        .unwrap();
        assert_eq!((f.shard_index(), f.shard().dtype()), (r, DType::F32));
        assert_eq!(f.shard().dims(), [5]);
        assert!(f.grad().is_none());
        flat.extend(f.shard().to_vec1::<f32>().unwrap());
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

/// A 2-rank FlatParameter of one 3-element parameter (shard 1: elements 2 and the padding 3).
fn small() -> FlatParameter {
    let l = layout(&[&[3]], 2);
    FlatParameter::from_fn(l, 1, &Device::Cpu, |_, range, out| {
        for (o, i) in out.iter_mut().zip(range) {
            *o = 10.0 + i as f32;
        }
        Ok(())
    })
    .unwrap()
}

fn vec1(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

// Gradient accumulation (widening, in place, refusals) is the parameter group's: its unit
// tests are in src/fsdp/param_group.rs.

#[test]
fn setters_check_length_dtype_and_name_expected_and_found() {
    let mut f = small();
    let e = f
        .set_shard(Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("shard") && e.contains("2 elements") && e.contains("[3]"),
        "{e}"
    );
    let e = f
        .set_shard(Tensor::zeros(2, DType::BF16, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("f32") && e.contains("BF16"), "{e}");
    let e = f
        .set_grad(Some(
            Tensor::zeros((1, 2), DType::F32, &Device::Cpu).unwrap(),
        ))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gradient shard") && e.contains("[1, 2]"), "{e}");
    // Nothing changed by the refused calls.
    assert_eq!(vec1(f.shard()), [12.0, 0.0]);
    assert!(f.grad().is_none());
    f.set_shard(Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap())
        .unwrap();
    f.set_grad(Some(Tensor::new(&[3.0f32, 4.0], &Device::Cpu).unwrap()))
        .unwrap();
    assert_eq!(
        (vec1(f.shard()), vec1(f.grad().unwrap())),
        (vec![1.0, 2.0], vec![3.0, 4.0])
    );
    f.set_grad(None).unwrap();
    assert!(f.grad().is_none());
}
