// One factory per codec, each defined in the codec's own file. make_codec() dispatches here.
#pragma once

#include <memory>

#include "gradcomp/codec.h"
#include "gradcomp/spec.h"

namespace gradcomp {

std::unique_ptr<Codec> make_none(Spec& spec);
std::unique_ptr<Codec> make_fp16(Spec& spec);
std::unique_ptr<Codec> make_bf16(Spec& spec);
std::unique_ptr<Codec> make_qsgd(Spec& spec);
std::unique_ptr<Codec> make_terngrad(Spec& spec);
std::unique_ptr<Codec> make_natural(Spec& spec);
std::unique_ptr<Codec> make_dither(Spec& spec);
std::unique_ptr<Codec> make_signsgd(Spec& spec);
std::unique_ptr<Codec> make_efsignsgd(Spec& spec);
std::unique_ptr<Codec> make_signum(Spec& spec);
std::unique_ptr<Codec> make_onebit(Spec& spec);
std::unique_ptr<Codec> make_topk(Spec& spec);
std::unique_ptr<Codec> make_randomk(Spec& spec);
std::unique_ptr<Codec> make_dgc(Spec& spec);
std::unique_ptr<Codec> make_threshold(Spec& spec);
std::unique_ptr<Codec> make_powersgd(Spec& spec);
std::unique_ptr<Codec> make_intq(Spec& spec);

}  // namespace gradcomp
