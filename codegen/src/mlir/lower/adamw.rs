//! The fused form of the AdamW update (`adamw`; in the role modules a runtime call): one
//! `linalg.generic` over the parameter doing what the runtime's AdamW instruction does,
//! with `megac_kernels::optim::adamw_step`'s f32 operations in its order.
//!
//! The per-step scalars are not in the plan: the kernel takes them as one more argument,
//! `%sc: memref<8xf32>` ([`SCALARS`] in order: `decay`, `w1`, `beta2`, `w2`, `bc2_sqrt`,
//! `eps`, `neg_step_size` of `megac_kernels::optim::step_scalars`, then `1 / loss_scale`
//! rounded to f32), which the runtime fills before each call. The global gradient norm is
//! read from its buffer: a non-finite norm skips the update (fp16's overflow), else the
//! gradient is multiplied by `1 / loss_scale` (by 1.0, exactly itself, without a loss
//! scale), then by the clipping coefficient `max_norm / (norm + 1e-6)` where that is below
//! 1, and written back as the runtime does. The moments' updates are fused multiply-adds
//! (`math.fma`) as the Rust kernel's `mul_add`. With a master copy (mixed precision) the
//! f32 master weight is stepped and rounded once into the 16-bit working weight.

use super::*;

/// How many f32 scalars the kernel's last argument holds.
pub const SCALARS: usize = 8;

/// The fused AdamW of `inputs` (param, grad, norm) and `outputs` (param, m, v[, master]);
/// `None` outside the fused form or for operands it does not expect.
pub(super) fn adamw(f: &mut Func, op: &OpKind, inputs: &[BufId], outputs: &[BufId]) -> Option<()> {
    let OpKind::AdamW {
        beta1,
        weight_decay,
        max_norm,
        master,
        ..
    } = op
    else {
        return None;
    };
    if f.buffer_args.is_none() || inputs.len() != 3 || outputs.len() != 3 + usize::from(*master) {
        return None;
    }
    let p: Arg = f.view(outputs[0]).into();
    let g: Arg = f.view(inputs[1]).into();
    let norm: Arg = f.view(inputs[2]).into();
    let m: Arg = f.view(outputs[1]).into();
    let v: Arg = f.view(outputs[2]).into();
    let w: Option<Arg> = outputs.get(3).map(|&b| f.view(b).into());
    let f32s = [&g, &m, &v].into_iter().chain(w.as_ref());
    if f32s
        .clone()
        .any(|a| a.dtype != DType::F32 || a.shape != p.shape)
        || norm.dtype != DType::F32
        || norm.shape.iter().product::<u64>() != 1
        || (*master == (p.dtype == DType::F32))
    {
        return None;
    }
    f.scalars = true;
    let ty = format!("memref<{SCALARS}xf32>");
    let s: Vec<String> = (0..SCALARS as u64)
        .map(|k| {
            let i = f.index(k);
            let n = f.fresh("sc");
            f.line(format!("{n} = memref.load %sc[{i}] : {ty}"));
            n
        })
        .collect();
    let (decay, w1, beta2, w2, bc2, eps, nss, inv_ls) =
        (&s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6], &s[7]);
    // As `step_scalars`: whether weight decay applies and which lerp form.
    let apply_decay = f64::from(*weight_decay as f32) != 0.0;
    let w1_small = ((1.0 - f64::from(*beta1 as f32)) as f32).abs() < 0.5;
    let c0 = f.index(0);
    let nv = f.fresh("n");
    let zeros = vec![c0; norm.shape.len()].join(", ");
    f.line(format!(
        "{nv} = memref.load {}[{zeros}] : {}",
        norm.name, norm.ty
    ));
    let an = f.fresh("n");
    f.line(format!("{an} = math.absf {nv} : f32"));
    let inf = f.constant("0x7F800000", "f32");
    let fin = f.fresh("n");
    f.line(format!("{fin} = arith.cmpf one, {an}, {inf} : f32"));
    f.line(format!("scf.if {fin} {{"));
    let one = f.constant("1.0e0", "f32");
    let w1m1 = f.fresh("n");
    f.line(format!("{w1m1} = arith.subf {w1}, {one} : f32"));
    // torch.nn.utils.clip_grad_norm_'s coefficient, applied where below 1.
    let clip = (*max_norm > 0.0).then(|| {
        let mn = f.constant(&float_lit(f64::from(*max_norm as f32)), "f32");
        let tiny = f.constant(&float_lit(f64::from(1e-6f32)), "f32");
        let d = f.fresh("n");
        f.line(format!("{d} = arith.addf {nv}, {tiny} : f32"));
        let coef = f.fresh("n");
        f.line(format!("{coef} = arith.divf {mn}, {d} : f32"));
        let lt = f.fresh("n");
        f.line(format!("{lt} = arith.cmpf olt, {coef}, {one} : f32"));
        (coef, lt)
    });
    let r = p.shape.len();
    let id = ds(0..r);
    let mut outs: Vec<(&Arg, Vec<String>)> =
        vec![(&g, id.clone()), (&m, id.clone()), (&v, id.clone())];
    outs.push((w.as_ref().unwrap_or(&p), id.clone()));
    if w.is_some() {
        outs.push((&p, id.clone()));
    }
    let pdt = elem(p.dtype);
    generic(f, r, &[], &[], &outs, |b, _, o| {
        let mut gi = b.mul(&o[0], inv_ls);
        if let Some((coef, lt)) = &clip {
            let gc = b.mul(&gi, coef);
            gi = b.op(format!("arith.select {lt}, {gc}, {gi} : f32"));
        }
        let mut pi = o[3].clone();
        if apply_decay {
            pi = b.mul(&pi, decay);
        }
        let dm = b.sub(&gi, &o[1]);
        let mi = if w1_small {
            b.op(format!("math.fma {w1}, {dm}, {} : f32", o[1]))
        } else {
            b.op(format!("math.fma {w1m1}, {dm}, {gi} : f32"))
        };
        let t = b.mul(w2, &gi);
        let vb = b.mul(&o[2], beta2);
        let vi = b.op(format!("math.fma {t}, {gi}, {vb} : f32"));
        let sq = b.math("sqrt", &vi);
        let den = b.div(&sq, bc2);
        let den = b.add(&den, eps);
        let num = b.mul(nss, &mi);
        let q = b.div(&num, &den);
        let pi = b.add(&pi, &q);
        let mut ys = vec![gi, mi, vi, pi.clone()];
        if o.len() == 5 {
            ys.push(b.op(format!("arith.truncf {pi} : f32 to {pdt}")));
        }
        ys
    });
    f.line("}");
    Some(())
}
